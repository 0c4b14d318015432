"""One request's stream across engine failures.

A request is admitted to a serving generation (``supervisor.admission``) and its engine's
stream runs in a task of its own, so that a recovery can interrupt it (a hung engine never
raises by itself). When that generation fails mid-stream the request is parked and continued
with prompt + delivered tokens (``supervisor.continuation``) on another serving replica at
once, else on the replica's next generation, so that what the client reads equals a
fault-free run. A request that sees its engine die says so (``Dispatcher.engine_died``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Iterable

from supervisor import logs, testhooks
from supervisor.admission import Admission
from supervisor.carryover import Carryover
from supervisor.continuation import NotContinuable
from supervisor.dispatch import Dispatcher
from supervisor.generation import Generation, Interrupted, RequestFailed, is_engine_death
from supervisor.states import State

log = logs.get_logger("vllm_supervisor.requests")

_END = object()


class Streams:
    """The streams of one request path (``SupervisedEngineClient``). ``detokenizer(prompt_ids,
    params, request_id)`` builds the incremental detokenizer a seam continues the text with;
    ``tokenizer()`` is the request path's current tokenizer (for the test hook)."""

    def __init__(self, dispatcher: Dispatcher, admission: Admission,
                 detokenizer: Callable[[list[int], Any, str], Any], tokenizer: Callable[[], Any],
                 reasoning_parser: Callable[[], str] = lambda: ""):
        self.d = dispatcher
        self.admission = admission
        self._detokenizer = detokenizer
        self._tokenizer = tokenizer
        self._reasoning_parser = reasoning_parser  # the engines' --reasoning-parser ("" without)
        self.in_flight = 0
        self.held = 0  # streams stopped by the test hook
        self.test_hooks = testhooks.enabled()  # False in production
        self.idle = asyncio.Event()
        self.idle.set()
        self._live: dict[str, tuple[Generation, str]] = {}  # client request id -> (generation, engine id)

    async def run(self, prompt: Any, sampling_params: Any, request_id: str,
                  kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """Stream ``RequestOutput``s; across a recovery the stream continues on the next
        engine with prompt + delivered tokens (``Carryover``: what the client read, and the
        text and logprobs' token strings after a seam as the first engine would make them)."""
        d = self.d
        req = Carryover(prompt, sampling_params, kwargs, request_id, self._detokenizer, self._tokenizer,
                        reasoning=bool(self._reasoning_parser()))
        params = req.params
        seen_output = False
        hold_at = testhooks.hold_point(params) if self.test_hooks else None
        attempt = 0
        dead: Generation | None = None  # the generation this request last saw fail
        arrived = last = time.monotonic()
        m = d.metrics
        n_prompt = len(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else None
        log.info("request", request_id=request_id, prompt_tokens=n_prompt, max_tokens=params.max_tokens,
                 n=params.n, output_kind=params.output_kind.name)
        self.admission.claim_reservation()
        self.in_flight += 1
        self.idle.clear()
        try:
            while True:
                route_ids = req.prompt_ids or (prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None)
                gen = await self.admission.admit(parked=attempt > 0, not_gen=dead, token_ids=route_ids)
                try:
                    sub, engine_prompt, kw = req.next_request()
                except NotContinuable as exc:
                    d.count_outcome("failed")
                    raise RequestFailed(f"request interrupted by an engine failure and cannot be continued exactly ({exc}); retry it") from None
                rid = request_id if attempt == 0 else f"{request_id}-c{attempt}"
                stream = self.pump(gen, engine_prompt, sub, rid, kw, client_id=request_id)
                try:
                    async for out in stream:
                        out = req.take(out)
                        ids = out.outputs[0].token_ids
                        now = time.monotonic()
                        if not seen_output:
                            seen_output = True
                            m.ttft.observe(now - arrived)
                        elif ids:
                            m.itl.observe((now - last) / len(ids))
                        last = now
                        if req.final_only and out.finished:  # one output at the end, as the front asked
                            out = req.final(out)
                        if out.finished or not req.final_only:
                            req.yielded = True
                            yield out
                        if out.finished:
                            break  # a stop string found across the seam ends the request here
                        if hold_at is not None and attempt == 0:
                            await self._maybe_hold(gen, req.ids, *hold_at)
                    m.e2e.observe(time.monotonic() - arrived)
                    d.count_outcome("continued" if attempt else "ok")
                    log.info("request done", request_id=request_id, attempts=attempt + 1,
                             delivered_tokens=len(req.ids) if req.delta else None)
                    return
                except Interrupted:
                    pass
                except Exception as exc:
                    if not is_engine_death(exc, gen):
                        raise
                    d.engine_died(gen, f"{type(exc).__name__}: {exc}")
                finally:
                    await stream.aclose()
                dead = gen  # the owner may not have marked it failed yet: never re-admit to it
                attempt += 1
                if attempt > d.cfg.continuation_limit:
                    d.count_outcome("failed")
                    raise RequestFailed(f"request interrupted {attempt} times by engine failures (limit {d.cfg.continuation_limit}); retry it")
                log.info("request parked", request_id=request_id, delivered_tokens=len(req.ids), attempt=attempt)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def abort(self, request_ids: Iterable[str]) -> None:
        """Abort on whichever generation holds each request now."""
        for rid in request_ids:
            held = self._live.get(rid)
            if held is not None and held[0].engine is not None and not held[0].failed:
                await held[0].engine.abort(held[1])

    async def _maybe_hold(self, gen: Generation, delivered: list[int], after: int, midchar: bool = True) -> None:
        """Test hook (``supervisor.testhooks``): stop a first-engine stream, once ``after`` tokens
        were delivered, right after a token that ends inside a UTF-8 character (``midchar``) or
        at once, until its engine fails."""
        d = self.d
        if len(delivered) < after or (midchar and not testhooks.ends_mid_character(self._tokenizer(), delivered)):
            return
        self.held += 1
        try:  # until the engine fails, or the daemon stops (then the stream just goes on)
            while not gen.failed and d.state is not State.STOPPING and not d.state.terminal:
                d.changed.clear()
                await d.changed.wait()
        finally:
            self.held -= 1
        if gen.failed:
            raise Interrupted()

    async def pump(self, gen: Generation, prompt: Any, params: Any, request_id: str,
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
