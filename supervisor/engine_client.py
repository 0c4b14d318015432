"""The request path: vLLM's ``EngineClient`` over whichever engine generation serves now.

vLLM's own OpenAI front (``supervisor.http``) talks to this object exactly as ``vllm serve``
talks to its ``AsyncLLM``. ``generate`` admits a request to a serving generation (the
replica with the fewest streams, ``supervisor.replica.pick``), and when that generation
fails mid-stream parks the request and continues it with prompt + delivered tokens
(``supervisor.continuation``) on another serving replica at once, else on the replica's next
generation, so that what the client reads equals a fault-free run. Calls that change an
engine's state (LoRA, caches, sleep, pause, profiling) go to every serving replica. The model config, renderer and tokenizer belong to this object,
not to a generation: they stay the same across recoveries.

The lifecycle owner (``supervisor.daemon.Supervisor``) decides which generation serves;
this module only reads its state and posts ``EngineFailed`` when a request sees an engine die.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Iterable

from vllm.engine.protocol import EngineClient
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

from executor.canary import CANARY_PREFIX
from supervisor import aio, logs, testhooks
from supervisor.continuation import NotContinuable, SeamText, continuation_params, why_not_continuable
from supervisor.generation import EngineUnavailable, Generation, Interrupted, RequestFailed, is_engine_death
from supervisor.states import State

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor

log = logs.get_logger("vllm_supervisor.requests")

_END = object()
_RESERVATION_S = 10.0  # an admission slot reserved by check_admission, unused, is freed after this


def continuation_input(prompt: Any, prompt_ids: list[int], delivered: list[int]) -> dict[str, Any]:
    """The engine input that resumes a request: its prompt tokens + the delivered tokens."""
    if isinstance(prompt, dict) and prompt.get("type", "token") != "token":
        raise NotContinuable(f"{prompt['type']} prompts are not continued")
    out: dict[str, Any] = {"type": "token", "prompt_token_ids": list(prompt_ids) + list(delivered)}
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        out["cache_salt"] = prompt["cache_salt"]
    return out


class SupervisedEngineClient(EngineClient):
    """``EngineClient`` whose engine survives worker deaths (see the module docstring)."""

    def __init__(self, owner: "Supervisor"):
        self.owner = owner
        self.vllm_config: Any = None  # set by attach(), from the first engine
        self.model_config: Any = None
        self.renderer: Any = None
        self.input_processor: Any = None
        self.tokenizer: Any = None
        self.supported_tasks: tuple[str, ...] = ()
        self.config_version = 0  # +1 per attach(): the HTTP front rebuilds vLLM's app on a change
        self.epoch = 0  # the engine arguments (EngineBuilder.config_epoch) of the engine it attached to
        self.in_flight = 0
        self.waiting_new = 0  # new requests queued for admission
        self.parked = 0  # in-flight requests waiting for the next generation
        self.held = 0  # streams stopped by the test hook
        # Engines held on purpose (``pause_generation``, ``sleep``) until ``resume_generation`` /
        # ``wake_up``: the probe does not take their stillness for a hang.
        self.holds: set[str] = set()
        self.released_monotonic = 0.0  # when the last hold ended
        self._test_hooks = testhooks.enabled()  # False in production
        self.idle = asyncio.Event()
        self.idle.set()
        self._live: dict[str, tuple[Generation, str]] = {}  # client request id -> (generation, engine id)
        self._reserved: collections.deque[float] = collections.deque()  # admission slots taken by check_admission

    def attach(self, engine: Any, tasks: tuple[str, ...], front: tuple[Any, Any], epoch: int = 0) -> None:
        """Take the model config and tasks of the first engine (and again after a reload
        changed engine arguments); ``front`` is this client's own (renderer, input
        processor), which outlive every generation. From now on requests go to generations
        built for ``epoch`` only."""
        old = self.renderer
        self.epoch = epoch
        self.vllm_config, self.model_config = engine.vllm_config, engine.model_config
        self.renderer, self.input_processor = front
        self.tokenizer = self.renderer.get_tokenizer()
        self.supported_tasks = tuple(tasks)
        self.config_version += 1
        if old is not None and old is not self.renderer and hasattr(old, "shutdown"):
            old.shutdown()

    # --- state that vLLM's front reads -----------------------------------------------

    @property
    def is_running(self) -> bool:
        """False only once the daemon is terminal: vLLM's front then stops serving."""
        return not self.owner.state.terminal

    @property
    def is_stopped(self) -> bool:
        return self.owner.state.terminal

    @property
    def errored(self) -> bool:
        """True only when no engine will come back (FAILED); a recovery is not an error."""
        return self.owner.state is State.FAILED

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(f"vllm-supervisor is {self.owner.state.value}: {self.owner.machine.reason}")

    async def check_health(self) -> None:
        """``/health``: 200 while an engine serves, else 503 (vLLM answers 503 to this error)."""
        gen = self.owner.pick()
        if gen is None:
            raise EngineDeadError(f"no engine serving: daemon is {self.owner.state.value} ({self.owner.machine.reason})")
        await gen.engine.check_health()

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Before the response starts: a stopping daemon or a full admission queue is a 503."""
        owner = self.owner
        if (gen := owner.pick()) is not None:
            gen.engine.check_admission(n, request_id)
            return
        # The front awaits (renders the prompt) between this check and ``generate``: a slot is
        # reserved here, so that a burst gets its 503s now, as a status, not in a started stream.
        now = time.monotonic()
        while self._reserved and now - self._reserved[0] > _RESERVATION_S:
            self._reserved.popleft()
        self._refuse_new(self.waiting_new + len(self._reserved))
        self._reserved.append(now)

    def _refuse_new(self, waiting: int) -> None:
        """A new request gets a 503 while the daemon stops or ``waiting`` fills the admission queue."""
        owner = self.owner
        if owner.state.terminal or owner.state is State.STOPPING:
            owner.count_outcome("rejected")
            raise EngineUnavailable(f"daemon is {owner.state.value}: {owner.machine.reason}")
        if waiting >= owner.cfg.admission_queue_size:
            owner.count_outcome("rejected")
            raise EngineUnavailable(f"daemon is {owner.state.value} and its admission queue is full ({owner.cfg.admission_queue_size})")

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self.supported_tasks

    # --- requests --------------------------------------------------------------------

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """Stream ``RequestOutput``s; across a recovery the stream continues on the next
        engine with prompt + delivered tokens.

        After a seam the text and the stop strings come from a ``SeamText`` that has seen
        the original prompt and every delivered token; the new engine supplies token ids.
        The front's non-streaming mode (``FINAL_ONLY``) is run as a stream here and answered
        with one output at the end, so it continues mid-way too; when it cannot be
        continued it is run as asked and, interrupted, simply runs again (nothing was sent)."""
        owner = self.owner
        params = sampling_params
        final_only = (params.output_kind == RequestOutputKind.FINAL_ONLY and params.n == 1
                      and why_not_continuable(params) is None)
        if final_only:
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.DELTA
        pristine = copy.deepcopy(params)
        delta = params.output_kind == RequestOutputKind.DELTA
        prompt_ids: list[int] | None = None
        first_prompt_text: str | None = None
        delivered: list[int] = []
        delivered_text: list[str] = []
        yielded = seen_output = False
        first_prompt_logprobs: Any = None
        seam: SeamText | None = None
        hold_after = testhooks.hold_midchar_after(params) if self._test_hooks else None
        attempt = 0
        dead: Generation | None = None  # the generation this request last saw fail
        arrived = last = time.monotonic()
        m = owner.metrics
        n_prompt = len(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else None
        log.info("request", request_id=request_id, prompt_tokens=n_prompt, max_tokens=params.max_tokens,
                 n=params.n, output_kind=params.output_kind.name)
        if self._reserved:
            self._reserved.popleft()  # this request's slot is now counted in waiting_new, if it waits
        self.in_flight += 1
        self.idle.clear()
        try:
            while True:
                route_ids = prompt_ids or (prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None)
                gen = await self._admit(parked=attempt > 0, not_gen=dead, token_ids=route_ids)
                try:
                    if not yielded and not delivered:
                        sub, engine_prompt, kw = copy.deepcopy(pristine), prompt, kwargs
                    else:
                        if not delta or params.n != 1:  # a FINAL_ONLY output is only yielded at the end
                            raise NotContinuable("n > 1" if params.n != 1 else f"output kind {params.output_kind.name}")
                        sub = continuation_params(pristine, len(delivered))
                        engine_prompt = continuation_input(prompt, prompt_ids or [], delivered)
                        kw = {k: v for k, v in kwargs.items() if k not in ("prompt_text", "tokenization_kwargs")}
                        if seam is None:
                            seam = SeamText(owner.new_detokenizer(prompt_ids or [], pristine, request_id),
                                            delivered, "".join(delivered_text))
                except NotContinuable as exc:
                    owner.count_outcome("failed")
                    raise RequestFailed(f"request interrupted by an engine failure and cannot be continued exactly ({exc}); retry it") from None
                rid = request_id if attempt == 0 else f"{request_id}-c{attempt}"
                stream = self._pump(gen, engine_prompt, sub, rid, kw, client_id=request_id)
                try:
                    async for out in stream:
                        c = out.outputs[0]
                        if prompt_ids is None:
                            prompt_ids, first_prompt_text = list(out.prompt_token_ids or []), getattr(out, "prompt", None)
                            first_prompt_logprobs = getattr(out, "prompt_logprobs", None)
                        if seam is not None:
                            c.text, c.token_ids, c.finish_reason, c.stop_reason = seam.step(
                                c.token_ids, c.finish_reason, c.stop_reason)
                            out.prompt_token_ids, out.prompt, out.prompt_logprobs = prompt_ids, first_prompt_text, None
                            out.finished = c.finish_reason is not None
                        ids = c.token_ids
                        now = time.monotonic()
                        if not seen_output:
                            seen_output = True
                            m.ttft.observe(now - arrived)
                        elif ids:
                            m.itl.observe((now - last) / len(ids))
                        last = now
                        if delta:
                            delivered += ids
                            delivered_text.append(c.text)
                        if final_only and out.finished:  # one output at the end, as the front asked
                            c.text, c.token_ids = "".join(delivered_text), list(delivered)
                            out.prompt_logprobs = first_prompt_logprobs
                        if out.finished or not final_only:
                            yielded = True
                            yield out
                        if out.finished:
                            break  # a stop string found across the seam ends the request here
                        if hold_after is not None and attempt == 0:
                            await self._maybe_hold(gen, delivered, hold_after)
                    m.e2e.observe(time.monotonic() - arrived)
                    owner.count_outcome("continued" if attempt else "ok")
                    log.info("request done", request_id=request_id, attempts=attempt + 1,
                             delivered_tokens=len(delivered) if delta else None)
                    return
                except Interrupted:
                    pass
                except Exception as exc:
                    if not is_engine_death(exc, gen):
                        raise
                    owner.engine_died(gen, f"{type(exc).__name__}: {exc}")
                finally:
                    await stream.aclose()
                dead = gen  # the owner may not have marked it failed yet: never re-admit to it
                attempt += 1
                if attempt > owner.cfg.continuation_limit:
                    owner.count_outcome("failed")
                    raise RequestFailed(f"request interrupted {attempt} times by engine failures (limit {owner.cfg.continuation_limit}); retry it")
                log.info("request parked", request_id=request_id, delivered_tokens=len(delivered), attempt=attempt)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort on whichever generation holds the request now."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            held = self._live.get(rid)
            if held is not None and held[0].engine is not None and not held[0].failed:
                await held[0].engine.abort(held[1])

    async def _maybe_hold(self, gen: Generation, delivered: list[int], after: int) -> None:
        """Test hook (``supervisor.testhooks``): stop a first-engine stream right after a token
        that ends inside a UTF-8 character, until its engine fails."""
        owner = self.owner
        if len(delivered) < after or not testhooks.ends_mid_character(self.tokenizer, delivered):
            return
        self.held += 1
        try:  # until the engine fails, or the daemon stops (then the stream just goes on)
            while not gen.failed and owner.state is not State.STOPPING and not owner.state.terminal:
                owner.changed.clear()
                await owner.changed.wait()
        finally:
            self.held -= 1
        if gen.failed:
            raise Interrupted()

    async def _pump(self, gen: Generation, prompt: Any, params: Any, request_id: str,
                    kwargs: dict[str, Any] | None = None, client_id: str | None = None) -> AsyncIterator[Any]:
        """Run the engine's stream in a task of its own, so a recovery can interrupt it
        (a hung engine never raises by itself)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        client_id = client_id or request_id

        async def pump() -> None:
            try:
                async for out in gen.engine.generate(prompt, params, request_id, **(kwargs or {})):
                    gen.last_output_monotonic = time.monotonic()
                    queue.put_nowait(out)
                queue.put_nowait(_END)
            except asyncio.CancelledError:
                queue.put_nowait(Interrupted())
                raise
            except BaseException as exc:
                queue.put_nowait(exc)

        if gen.failed:
            raise Interrupted()
        task = asyncio.create_task(pump(), name=request_id)  # the hang check tells the canary by its id
        gen.pumps[task] = (time.monotonic(), queue)
        self._live[client_id] = (gen, request_id)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            gen.pumps.pop(task, None)
            if self._live.get(client_id, (None, None))[1] == request_id:
                del self._live[client_id]
            if not task.done():
                task.cancel()
                gen.lingering.add(task)
                task.add_done_callback(gen.lingering.discard)

    async def canary(self, gen: Generation) -> None:
        """One greedy token on ``gen`` (the idle hang probe)."""
        from vllm import SamplingParams

        async for _ in self._pump(gen, {"type": "token", "prompt_token_ids": [0]}, SamplingParams(max_tokens=1, temperature=0),
                                  f"{CANARY_PREFIX}{uuid.uuid4().hex[:8]}"):
            pass

    async def _admit(self, parked: bool, not_gen: Generation | None = None, token_ids: Any = None) -> Generation:
        """A serving generation once READY (and not ``not_gen``, a generation the request saw
        die before the owner task marked it failed). New requests wait in a bounded queue up
        to ``admission_timeout_s``; parked ones wait up to ``recovery_timeout_s``. ``token_ids``:
        the prompt, for prefix-aware routing between replicas."""
        owner = self.owner
        if (gen := owner.pick(not_gen, parked, token_ids)) is not None:
            return gen
        if parked and (owner.state.terminal or owner.state is State.STOPPING):
            owner.count_outcome("failed")
            raise RequestFailed(f"daemon is {owner.state.value} ({owner.machine.reason}); retry the request elsewhere")
        if not parked:
            self._refuse_new(self.waiting_new)
        timeout = owner.cfg.recovery_timeout_s if parked else owner.cfg.admission_timeout_s
        deadline = time.monotonic() + timeout
        if parked:
            self.parked += 1
        else:
            self.waiting_new += 1
        try:
            while True:
                if (gen := owner.pick(not_gen, parked, token_ids)) is not None:
                    return gen
                if owner.state.terminal or owner.state is State.STOPPING:
                    return await self._admit(parked, not_gen, token_ids)
                left = deadline - time.monotonic()
                if left <= 0:
                    if parked:
                        owner.count_outcome("failed")
                        raise RequestFailed(f"no engine within {timeout:g} s ({owner.machine.reason}); retry the request")
                    owner.count_outcome("rejected")
                    raise EngineUnavailable(f"daemon is {owner.state.value} ({owner.machine.reason}); no engine within {timeout:g} s")
                owner.changed.clear()
                try:
                    await aio.wait_for(owner.changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            if parked:
                self.parked -= 1
            else:
                self.waiting_new -= 1

    # --- the rest of EngineClient: the serving engines', or "unavailable" -----------------

    def _engine(self) -> Any:
        """One serving engine (for a call about one request)."""
        return self._engines()[0]

    def _engines(self) -> list[Any]:
        """Every serving replica's engine (for a call that changes an engine's state)."""
        owner = self.owner
        engines = ([r.current.engine for r in owner.replicas if r.serving() and r.current.epoch == self.epoch]
                   if owner.state is State.READY else [])
        if not engines:
            raise EngineUnavailable(f"no engine serving: daemon is {owner.state.value} ({owner.machine.reason})")
        return engines

    async def _each(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        engines = self._engines()
        return list(await asyncio.gather(*(getattr(e, method)(*args, **kwargs) for e in engines)))

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine().encode(*args, **kwargs)

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        await self._engine().notify_kv_transfer_request_rejected(*args, **kwargs)

    async def is_tracing_enabled(self) -> bool:
        return bool(self.vllm_config and self.vllm_config.observability_config.otlp_traces_endpoint)

    async def do_log_stats(self) -> None:
        if self.owner.serving():
            await self._each("do_log_stats")

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        await self._each("start_profile", *args, **kwargs)

    async def stop_profile(self) -> None:
        await self._each("stop_profile")

    async def reset_mm_cache(self) -> None:
        await self._each("reset_mm_cache")

    async def reset_encoder_cache(self) -> None:
        await self._each("reset_encoder_cache")

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        return all(await self._each("reset_prefix_cache", *args, **kwargs))

    def _hold(self, reason: str) -> None:
        self.holds.add(reason)

    def _release(self, reason: str) -> None:
        if reason in self.holds:
            self.holds.discard(reason)
            self.released_monotonic = time.monotonic()

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        self._hold("sleep")
        await self._each("sleep", *args, **kwargs)

    async def release_kv_cache_memory(self) -> None:
        await self._each("release_kv_cache_memory")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        try:
            return all(await self._each("wake_up", tags))
        finally:
            self._release("sleep")

    async def is_sleeping(self) -> bool:
        return bool(self.owner.serving() and any(await self._each("is_sleeping")))

    async def add_lora(self, lora_request: Any) -> bool:
        return all(await self._each("add_lora", lora_request))

    async def pause_generation(self, **kwargs: Any) -> None:
        self._hold("pause")
        await self._each("pause_generation", **kwargs)

    async def resume_generation(self) -> None:
        try:
            await self._each("resume_generation")
        finally:
            self._release("pause")

    async def is_paused(self) -> bool:
        return bool(self.owner.serving() and any(await self._each("is_paused")))

    def shutdown(self, timeout: float | None = None) -> None:
        """The daemon owns the engines' lifetime (SIGTERM drains and tears down)."""
