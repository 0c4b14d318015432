"""The request path: vLLM's ``EngineClient`` over whichever engine generation serves now.

vLLM's own OpenAI front (``supervisor.http``) talks to this object exactly as ``vllm serve``
talks to its ``AsyncLLM``. ``generate`` admits a request to a serving generation (the
replica with the fewest streams, ``supervisor.replica.pick``; ``supervisor.admission``), and
when that generation fails mid-stream continues the request on another
(``supervisor.stream``), so that what the client reads equals a fault-free run. Calls that
change an engine's state (LoRA, caches, sleep, pause, profiling) go to every serving replica.
The model config, renderer and tokenizer belong to this object, not to a generation: they
stay the same across recoveries.

The daemon decides which generation serves; this object sees it only as a ``Dispatcher``
(``supervisor.dispatch``): it reads its state and reports outcomes and engines seen to die.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncGenerator, Callable, Iterable

from vllm.engine.protocol import EngineClient
from vllm.v1.engine.exceptions import EngineDeadError

from executor.canary import CANARY_PREFIX
from executor.engine import new_detokenizer  # vLLM's own (vLLM internals stay in executor/)
from executor.history import history_refusal, replay_refusal
from supervisor.admission import Admission
from supervisor.continuation import Engines
from supervisor.dispatch import Dispatcher
from supervisor.generation import EngineUnavailable, Generation
from supervisor.states import State
from supervisor.stream import Streams


class SupervisedEngineClient(EngineClient):
    """``EngineClient`` whose engine survives worker deaths (see the module docstring)."""

    def __init__(self, dispatcher: Dispatcher, log_requests: Callable[[], bool] = lambda: False):
        self.d = dispatcher
        self.vllm_config: Any = None  # set by attach(), from the first engine
        self.model_config: Any = None
        self.renderer: Any = None
        self.input_processor: Any = None
        self.tokenizer: Any = None
        self.supported_tasks: tuple[str, ...] = ()
        self.engines = Engines()  # what the serving engines carry across a seam (set by attach())
        self.config_version = 0  # +1 per attach(): the HTTP front rebuilds vLLM's app on a change
        self.epoch = 0  # the engine arguments (EngineBuilder.config_epoch) of the engine it attached to
        # Builds the detokenizer a seam continues the text with: (tokenizer, prompt ids, params,
        # request id) -> vLLM's incremental detokenizer; replaceable (tests without a tokenizer).
        self.new_detokenizer: Callable[[Any, list[int], Any, str], Any] = new_detokenizer
        # Engines held on purpose (``pause_generation``, ``sleep``) until ``resume_generation`` /
        # ``wake_up``: the probe does not take their stillness for a hang.
        self.holds: set[str] = set()
        self.released_monotonic = 0.0  # when the last hold ended
        # The holds' own calls, for an engine built while they last (``hold_like_the_others``):
        # sleep's (args, kwargs) and the tags woken since; pause's kwargs.
        self.asleep: dict[str, Any] | None = None
        self.paused: dict[str, Any] | None = None
        self.admission = Admission(dispatcher)
        self.streams = Streams(dispatcher, self.admission,
                               lambda ids, params, rid: self.new_detokenizer(self.tokenizer, ids, params, rid),
                               lambda: self.tokenizer, lambda: self.engines, log_requests)

    # what the daemon's status, metrics and drain read
    in_flight = property(lambda self: self.streams.in_flight)
    idle = property(lambda self: self.streams.idle)  # set while no request is in flight
    held = property(lambda self: self.streams.held)  # streams stopped by the test hook
    _test_hooks = property(lambda self: self.streams.test_hooks)
    waiting_new = property(lambda self: self.admission.waiting_new)  # new requests queued for admission
    parked = property(lambda self: self.admission.parked)  # in-flight requests waiting for the next generation

    @staticmethod
    def _carried(vllm_config: Any) -> Engines:
        """What engines of ``vllm_config`` carry across a seam (``supervisor.continuation``)."""
        config = getattr(vllm_config, "structured_outputs_config", None)
        return Engines(reasoning=bool(getattr(config, "reasoning_parser", "")),
                       history=history_refusal(vllm_config), replay=replay_refusal(vllm_config))

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
        self.engines = self._carried(engine.vllm_config)
        self.config_version += 1
        if old is not None and old is not self.renderer and hasattr(old, "shutdown"):
            old.shutdown()

    # --- state that vLLM's front reads -----------------------------------------------

    @property
    def is_running(self) -> bool:
        """False only once the daemon is terminal: vLLM's front then stops serving."""
        return not self.d.state.terminal

    @property
    def is_stopped(self) -> bool:
        return self.d.state.terminal

    @property
    def errored(self) -> bool:
        """True only when no engine will come back (FAILED); a recovery is not an error."""
        return self.d.state is State.FAILED

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(f"vllm-supervisor is {self.d.state.value}: {self.d.reason}")

    async def check_health(self) -> None:
        """``/health``: 200 while an engine serves, else 503 (vLLM answers 503 to this error)."""
        gen = self.d.pick()
        if gen is None:
            raise EngineDeadError(f"no engine serving: daemon is {self.d.state.value} ({self.d.reason})")
        await gen.engine.check_health()

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """Before the response starts: a stopping daemon or a full admission queue is a 503."""
        if (gen := self.d.pick()) is not None:
            gen.engine.check_admission(n, request_id)
            return
        self.admission.reserve()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self.supported_tasks

    # --- requests --------------------------------------------------------------------

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """Stream ``RequestOutput``s, continued across engine failures (``Streams.run``)."""
        return self.streams.run(prompt, sampling_params, request_id, kwargs)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort on whichever generation holds the request now."""
        await self.streams.abort([request_id] if isinstance(request_id, str) else list(request_id))

    async def canary(self, gen: Generation) -> None:
        """One greedy token on ``gen`` (the idle hang probe)."""
        from vllm import SamplingParams

        async for _ in self.streams.read(gen, {"type": "token", "prompt_token_ids": [0]}, SamplingParams(max_tokens=1, temperature=0),
                                         f"{CANARY_PREFIX}{uuid.uuid4().hex[:8]}"):
            pass

    # --- the rest of EngineClient: the serving engines', or "unavailable" -----------------

    def _engine(self) -> Any:
        """One serving engine (for a call about one request)."""
        return self._engines()[0]

    def _engines(self) -> list[Any]:
        """Every serving replica's engine (for a call that changes an engine's state)."""
        d = self.d
        engines = ([r.current.engine for r in d.replicas if r.serving() and r.current.epoch == self.epoch]
                   if d.state is State.READY else [])
        if not engines:
            raise EngineUnavailable(f"no engine serving: daemon is {d.state.value} ({d.reason})")
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
        if self.d.serving():
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

    # The holds' state is written before their calls fan out, so that an engine being held
    # like the others (``hold_like_the_others``) sees every change that reaches them.

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        self._hold("sleep")
        self.asleep = {"args": args, "kwargs": kwargs, "level": kwargs.get("level", args[0] if args else 1), "woken": []}
        await self._each("sleep", *args, **kwargs)

    async def release_kv_cache_memory(self) -> None:
        await self._each("release_kv_cache_memory")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        if tags is None or self.asleep is None:
            self.asleep = None
        else:  # a partial wake (vLLM's tags: weights, kv_cache): the rest sleeps on
            self.asleep = {**self.asleep, "woken": sorted(set(self.asleep["woken"]) | set(tags))}
        try:
            woke = all(await self._each("wake_up", tags))
        finally:
            self._release("sleep")
        if self.asleep is not None and self.d.serving():
            with contextlib.suppress(Exception):
                if not any(await self._each("is_sleeping")):
                    self.asleep = None  # woken in full, tag by tag
        return woke

    async def is_sleeping(self) -> bool:
        return bool(self.d.serving() and any(await self._each("is_sleeping")))

    async def add_lora(self, lora_request: Any) -> bool:
        return all(await self._each("add_lora", lora_request))

    async def pause_generation(self, **kwargs: Any) -> None:
        self._hold("pause")
        self.paused = dict(kwargs)
        await self._each("pause_generation", **kwargs)

    async def resume_generation(self) -> None:
        self.paused = None
        try:
            await self._each("resume_generation")
        finally:
            self._release("pause")

    def holds_now(self) -> tuple[Any, Any]:
        """What an engine must be given before it serves: (asleep, paused)."""
        return self.asleep, self.paused

    async def hold_like_the_others(self, engine: Any, since: tuple[Any, Any] = (None, None)) -> tuple[list[str], tuple[Any, Any]]:
        """A newly built engine (a recovery's, a replica's) joins as the operator left the
        others, before it serves: asleep at the same level, woken as far as they were, paused;
        and follows every change made meanwhile (a wake or resume whose calls to the others were
        under way). Without this a recovery while the engines sleep (vLLM's sleep mode) would
        leave an awake engine holding the device memory lent to another process. A level-2
        sleep woken in part is not replayed: level 2 discards the weights, and the operator was
        loading new ones into the others; this engine has the model's own. ``since``: what it
        was given before. Returns what it did, and what it has been given: the owner serves it
        only if that is still ``holds_now()`` (its dispatch does not await: nothing changes
        between that check and serving), else it is held again."""
        done: list[str] = []
        slept, paused = since  # what this engine has been given
        while (self.asleep, self.paused) != (slept, paused):
            want, want_paused = self.asleep, self.paused
            if want != slept:
                if want is None:
                    await engine.wake_up(None)
                    done.append("wake_up")
                elif slept is None and want["level"] == 2 and want["woken"]:
                    done.append("left awake (level-2 sleep woken in part)")
                else:
                    if slept is None:
                        await engine.sleep(*want["args"], **want["kwargs"])
                        done.append(f"sleep level {want['level']}")
                    if tags := sorted(set(want["woken"]) - set(slept["woken"] if slept else ())):
                        await engine.wake_up(tags)
                        done.append(f"wake_up {tags}")
                slept = want
            if want_paused != paused:
                if want_paused is None:
                    await engine.resume_generation()
                    done.append("resume_generation")
                else:
                    await engine.pause_generation(**want_paused)
                    done.append("pause_generation")
                paused = want_paused
        return done, (slept, paused)

    async def is_paused(self) -> bool:
        return bool(self.d.serving() and any(await self._each("is_paused")))

    def shutdown(self, timeout: float | None = None) -> None:
        """The daemon owns the engines' lifetime (SIGTERM drains and tears down)."""
