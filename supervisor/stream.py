"""One request's stream across engine failures.

A request is admitted to a serving generation (``supervisor.admission``) and reads its
engine's stream in its own task, as ``vllm serve`` does, through a ``Reader`` the generation
lists, so that a recovery can interrupt it (a hung engine never raises by itself). When that generation fails mid-stream the request is parked and continued
with prompt + delivered tokens (``supervisor.continuation``) on another serving replica at
once, else on the replica's next generation, so that what the client reads equals a
fault-free run. A request that sees its engine die says so (``Dispatcher.engine_died``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Iterable

from vllm.sampling_params import RequestOutputKind

from supervisor import logs, testhooks
from supervisor.admission import Admission
from supervisor.carryover import Carryover
from supervisor.continuation import Engines, NotContinuable, child_params
from supervisor.dispatch import Dispatcher
from supervisor.events import Quarantined
from supervisor.generation import Generation, Interrupted, QueryOfDeath, RequestFailed, is_engine_death
from supervisor.states import State
from supervisor.suspects import blocking, fingerprint, may_join

log = logs.get_logger("vllm_supervisor.requests")

_END = object()
_NOT_WHOLE = contextlib.nullcontext()  # a choice of several: the request's bookkeeping is ``_choices``'


class _Request:
    """One client request's bookkeeping, entered in the body of the generator that streams it
    (``_choice`` for ``n = 1``, ``_choices`` else), so that a stream that is never read counts
    nothing: it is in flight from its first read to its end, its outcome is counted as it ends
    (a client that went away counts none), and its latency metrics are observed: time to its
    first output, between outputs (per token), arrival to its end. ``attempts``: the most any
    of its choices took."""

    __slots__ = ("streams", "m", "request_id", "prompt", "params", "arrived", "last", "seen", "attempts")

    def __init__(self, streams: "Streams", request_id: str, prompt: Any, params: Any):
        self.streams, self.m = streams, streams.d.metrics
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.arrived = self.last = 0.0
        self.seen = False
        self.attempts = 0

    def __enter__(self) -> "_Request":
        s, p = self.streams, self.params
        n_prompt = len(self.prompt.get("prompt_token_ids") or ()) if isinstance(self.prompt, dict) else None
        say = log.info if s._log_requests() else log.debug
        say("request", request_id=self.request_id, prompt_tokens=n_prompt, max_tokens=p.max_tokens,
            n=p.n, output_kind=p.output_kind.name)
        s.admission.claim_reservation()
        s.in_flight += 1
        s.idle.clear()
        self.arrived = self.last = time.monotonic()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        s = self.streams
        try:
            if kind is None:
                self.m.e2e.observe(time.monotonic() - self.arrived)
                s.d.count_outcome("continued" if self.attempts else "ok")
            elif issubclass(kind, RequestFailed):
                s.d.count_outcome("failed")
            elif issubclass(kind, QueryOfDeath):
                s.d.count_outcome("quarantined")
        finally:
            s.in_flight -= 1
            if s.in_flight == 0:
                s.idle.set()

    def output(self, tokens: int) -> None:
        now = time.monotonic()
        if not self.seen:
            self.seen = True
            self.m.ttft.observe(now - self.arrived)
        elif tokens:
            self.m.itl.observe((now - self.last) / tokens)
        self.last = now


class Streams:
    """The streams of one request path (``SupervisedEngineClient``). ``detokenizer(prompt_ids,
    params, request_id)`` builds the incremental detokenizer a seam continues the text with;
    ``tokenizer()`` is the request path's current tokenizer (for the test hook)."""

    def __init__(self, dispatcher: Dispatcher, admission: Admission,
                 detokenizer: Callable[[list[int], Any, str], Any], tokenizer: Callable[[], Any],
                 engines: Callable[[], Engines] = Engines, log_requests: Callable[[], bool] = lambda: False):
        self.d = dispatcher
        self.admission = admission
        self._detokenizer = detokenizer
        self._tokenizer = tokenizer
        self._engines = engines  # what the serving engines carry across a seam
        # a line as each request starts and ends, at info with vLLM's --enable-log-requests (as
        # `vllm serve` logs requests), else at debug: two JSON lines per request cost the front
        # about 2 % of its CPU at saturation (docs/benchmarks.md, run 11)
        self._log_requests = log_requests
        self.in_flight = 0
        self.held = 0  # streams stopped by the test hook
        self.test_hooks = testhooks.enabled()  # False in production
        self.idle = asyncio.Event()
        self.idle.set()
        # client request id -> {choice id: (generation, engine request id)}
        self._live: dict[str, dict[str, tuple[Generation, str]]] = {}

    def run(self, prompt: Any, sampling_params: Any, request_id: str,
            kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """Stream ``RequestOutput``s; across a recovery the stream continues on the next
        engine with prompt + delivered tokens. ``n > 1`` runs as ``n`` choices of one token
        stream each, as vLLM's own ``ParentRequest`` splits it, so each is continued alone.
        ``n = 1`` is its one choice's stream itself: no generator passes its outputs on (one
        layer less per output, ``bench.request_path``)."""
        request = _Request(self, request_id, prompt, sampling_params)
        if sampling_params.n == 1:
            return self._choice(prompt, sampling_params, request_id, kwargs, request, whole=True)
        return self._choices(prompt, sampling_params, request_id, kwargs, request)

    async def _choices(self, prompt: Any, params: Any, request_id: str, kwargs: dict[str, Any],
                       request: _Request) -> AsyncGenerator[Any, None]:
        """``n > 1``: each choice as a request of its own (``n = 1``, ``seed + index``, vLLM's
        child parameters), merged as vLLM's ``ParentRequest`` merges them: streamed, each
        output as it comes, finished with the last choice; not streamed, one output with the
        ``n`` final ones."""
        n, final_only = params.n, params.output_kind == RequestOutputKind.FINAL_ONLY
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def drive(index: int) -> None:
            try:
                async for out in self._choice(prompt, child_params(params, index), f"{index}_{request_id}",
                                              kwargs, request, client_id=request_id):
                    queue.put_nowait((index, out))
            except BaseException as exc:  # noqa: BLE001 (handed to the reader)
                queue.put_nowait((index, exc))
                return
            queue.put_nowait((index, _END))

        with request:
            tasks = [asyncio.create_task(drive(i), name=f"{i}_{request_id}") for i in range(n)]
            finals: list[Any] = [None] * n
            try:
                running = n
                while running:
                    index, out = await queue.get()
                    if out is _END:
                        running -= 1
                        continue
                    if isinstance(out, BaseException):
                        raise out
                    out.request_id = request_id
                    out.outputs[0].index = index
                    if out.finished:
                        finals[index] = out.outputs[0]
                    out.finished = all(c is not None for c in finals)
                    if not final_only:
                        yield out
                    elif out.finished:
                        out.outputs = list(finals)
                        yield out
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _choice(self, prompt: Any, sampling_params: Any, request_id: str, kwargs: dict[str, Any],
                      request: _Request, client_id: str | None = None, whole: bool = False) -> AsyncGenerator[Any, None]:
        """One token stream (``n = 1``) across engine failures (``Carryover``: what the client
        read, and the text and logprobs' token strings after a seam as the first engine would
        make them; its part in the failures, ``supervisor.suspects``). ``client_id``: the
        client's request id (``request_id`` is a choice's); ``whole``: the choice is the whole
        request (``n = 1``), whose bookkeeping it enters."""
        with request if whole else _NOT_WHOLE:
            d = self.d
            if len(d.quarantine) and isinstance(prompt, dict):  # each choice: its own seed and parameters
                print_ = fingerprint(prompt.get("prompt_token_ids"), sampling_params)
                if print_ in d.quarantine:
                    log.warning("request refused: its input crashed two engines", request_id=request_id, input_fingerprint=print_)
                    raise QueryOfDeath(f"request refused: the same input crashed two engines (a query of death) and is "
                                       f"refused for {d.cfg.quarantine_window_s:g} s (input fingerprint {print_})")
            req = Carryover(prompt, sampling_params, kwargs, request_id, self._detokenizer, self._tokenizer,
                            self._engines())
            hold_at = testhooks.hold_point(req.params) if self.test_hooks else None
            hold_engines = testhooks.hold_engines(req.params) if hold_at is not None else 0
            attempt = 0
            dead: tuple[Generation, ...] = ()  # the generations this request saw fail, the last one last
            client_id = client_id or request_id
            while True:
                gen = await self._admit(req, dead)
                try:
                    try:
                        sub, engine_prompt, kw = req.next_request()
                    except NotContinuable as exc:
                        raise RequestFailed(f"request interrupted by an engine failure and cannot be continued exactly ({exc}); retry it") from None
                    rid = request_id if attempt == 0 else f"{request_id}-c{attempt}"
                    stream = self.read(gen, engine_prompt, sub, rid, kw, client_id=client_id, choice=request_id)
                    try:
                        async for out in stream:
                            out = req.take(out)
                            request.output(len(out.outputs[0].token_ids))
                            if req.final_only and out.finished:  # one output at the end, as the front asked
                                out = req.final(out)
                            if out.finished or not req.final_only:
                                req.yielded = True
                                yield out
                            if out.finished:
                                break  # a stop string found across the seam ends the request here
                            if hold_at is not None and attempt < hold_engines:
                                # on a later engine, counted from there: the request is established there
                                # (``supervisor.suspects``), so its interruption counts as a plain one
                                count = req.suspect.outputs_here if attempt else len(req.ids)
                                await self._maybe_hold(gen, req.ids, count, *hold_at)
                        # a request continued across a failure is always told (its parking was too)
                        say = log.info if attempt or self._log_requests() else log.debug
                        say("request done", request_id=request_id, attempts=attempt + 1,
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
                    verdict = gen.failure_verdict()  # while every choice it ran is still listed
                finally:
                    gen.choices.pop(request_id, None)
                dead += (gen,)  # the owner may not have marked them failed yet: never re-admit to one
                attempt += 1
                request.attempts = max(request.attempts, attempt)
                suspect = req.suspect
                if suspect.failed(gen.number, request_id, verdict):
                    self._quarantine(req, gen, client_id)
                if suspect.interruptions > d.cfg.continuation_limit:
                    raise RequestFailed(f"request interrupted {suspect.interruptions} times by engine failures "
                                        f"(limit {d.cfg.continuation_limit}); retry it")
                log.info("request parked", request_id=request_id, delivered_tokens=len(req.ids), attempt=attempt,
                         implicated=request_id in verdict.implicated)

    async def _admit(self, req: Carryover, dead: tuple[Generation, ...]) -> Generation:
        """The generation ``req`` runs on next, where it is listed at once (``Generation.choices``).
        A request on probation (implicated in a failure, ``supervisor.suspects``) waits for its
        own replica's next generation and joins it once no request there is new; a new request
        joins a generation that took continued requests once none of those is new."""
        suspect, since = req.suspect, None
        replica = dead[-1].replica if suspect.on_probation and dead else None
        while True:
            gen = await self.admission.admit(parked=bool(dead), not_gens=dead, token_ids=req.token_ids, replica=replica)
            if not gen.took_continued and not suspect.on_probation:
                break  # the steady state: nobody was continued onto this engine
            since = since or time.monotonic()  # the wait counts from the first engine it could join
            others = (r.suspect for r in gen.choices.values())
            if may_join(blocking(suspect, others, self.admission.parked), time.monotonic() - since):
                break
            await asyncio.sleep(0.05)
        suspect.outputs_here = 0
        suspect.joined += 1
        gen.took_continued |= suspect.continued
        gen.choices[req.request_id] = req  # before any await: whoever joins next sees it new
        return gen

    def _quarantine(self, req: Carryover, gen: Generation, client_id: str) -> None:
        """``req`` crashed two engines: its input is refused from now on and it ends here."""
        print_ = fingerprint(req.token_ids, req.pristine)
        generations = tuple(req.suspect.implicated)
        self.d.crashed_engines(Quarantined(gen.replica, generations, client_id, print_))
        raise QueryOfDeath(f"request quarantined: it was new on engine generations {', '.join(map(str, generations))} "
                           f"when each of them crashed (a query of death); the same input is refused for "
                           f"{self.d.cfg.quarantine_window_s:g} s (input fingerprint {print_})")

    async def abort(self, request_ids: Iterable[str]) -> None:
        """Abort on whichever generation holds each request now."""
        for rid in request_ids:
            for gen, engine_id in list(self._live.get(rid, {}).values()):
                if gen.engine is not None and not gen.failed:
                    await gen.engine.abort(engine_id)

    async def _maybe_hold(self, gen: Generation, delivered: list[int], count: int, after: int, midchar: bool = True) -> None:
        """Test hook (``supervisor.testhooks``): stop a stream on its engine, once ``count``
        (tokens delivered, or outputs read from a later engine) reached ``after``, right after a
        token that ends inside a UTF-8 character (``midchar``) or at once, until its engine fails."""
        d = self.d
        if count < after or (midchar and not testhooks.ends_mid_character(self._tokenizer(), delivered)):
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

    async def read(self, gen: Generation, prompt: Any, params: Any, request_id: str,
                   kwargs: dict[str, Any] | None = None, client_id: str | None = None,
                   choice: str | None = None) -> AsyncIterator[Any]:
        """Read the engine's stream in the reader's own task, as ``vllm serve``'s front reads
        ``AsyncLLM.generate`` (no task or queue between them: vLLM's per-request collector
        already merges the deltas of a reader that falls behind). A recovery interrupts it
        through its ``Reader`` (``Generation.interrupt_streams``): a hung engine never raises
        by itself."""
        if gen.failed:
            raise Interrupted()
        client_id = client_id or request_id
        choice = choice or client_id
        reader = Reader(request_id)  # the hang check tells the canary by its name
        gen.readers.add(reader)
        self._live.setdefault(client_id, {})[choice] = (gen, request_id)
        stream = gen.engine.generate(prompt, params, request_id, **(kwargs or {}))
        ended = False  # the engine's generator has finished (returned or raised)
        last = None  # a finished output, yielded once vLLM's generator has returned after it
        try:
            while True:
                if reader.interrupted:
                    raise Interrupted()
                reader.wait()
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    ended = True
                    break
                except BaseException:
                    ended = True
                    if reader.let_go(gen.lingering):
                        raise Interrupted() from None
                    raise
                finally:
                    reader.waiting = False
                gen.last_output_monotonic = time.monotonic()
                if last is not None:  # not the last after all
                    yield last
                    last = None
                if getattr(out, "finished", False):
                    last = out  # vLLM's generate returns right after it: read on, so that a
                    continue  # finished request ends as in ``vllm serve``, not by vLLM's abort
                yield out
            if last is not None:
                yield last
        finally:
            gen.readers.discard(reader)
            live = self._live.get(client_id, {})
            if live.get(choice, (None, None))[1] == request_id:
                del live[choice]
                if not live:
                    del self._live[client_id]
            if not ended:  # interrupted between outputs, or its reader stopped reading: vLLM's
                # own close aborts the request (on a dead engine it may never return: off the reader)
                closing = asyncio.create_task(stream.aclose(), name=f"close-{request_id}")
                gen.lingering.add(closing)
                closing.add_done_callback(_closed(gen.lingering))


def _closed(lingering: set) -> Callable[[asyncio.Task], None]:
    def done(task: asyncio.Task) -> None:
        lingering.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("closing an engine stream failed", request_id=task.get_name(), error=repr(task.exception()))
    return done


class Reader:
    """One engine stream's reader as its generation lists it (``Generation.readers``): what a
    recovery interrupts (``Generation.interrupt_streams``). Marked ``interrupted``, whatever
    ends its wait on the engine (vLLM's engine-dead error, or the cancel of that wait, taken
    back as ``asyncio.timeout`` takes its own back: ``let_go``) makes it raise
    ``Interrupted``, and the client's task goes on. A cancel that is not ours (the client
    went away) stays a cancel."""

    __slots__ = ("name", "task", "waiting", "since", "interrupted", "cancels", "base")

    def __init__(self, name: str):
        self.name = name
        self.task: asyncio.Task | None = None  # the task that waits on the engine
        self.waiting = False  # inside the engine's ``__anext__``
        self.since = 0.0  # when that wait began (the hang check's clock)
        self.interrupted = False
        self.cancels = 0  # ours, not yet taken back
        self.base = 0  # the task's cancel count when its wait began (others' since are not ours)

    def get_name(self) -> str:
        return self.name

    def wait(self) -> None:
        """It is about to wait on the engine, in the current task."""
        self.task, self.waiting, self.since = asyncio.current_task(), True, time.monotonic()
        self.base = self.task.cancelling() if self.task is not None else 0

    def cancel(self) -> bool:
        """Cancel its wait on the engine; False when it is not waiting."""
        if not self.waiting or self.task is None:
            return False  # between outputs: it sees ``interrupted`` before it reads again
        if not self.task.cancel("interrupted by an engine failure"):
            return False
        self.cancels += 1
        return True

    def let_go(self, lingering: set) -> bool:
        """It came out of its wait with an exception: True when that means it was
        interrupted (our own cancels taken back, and nobody else's added since)."""
        lingering.discard(self)
        if not self.interrupted:
            return False
        while self.cancels:
            self.cancels -= 1
            self.task.uncancel()
        return self.task is None or self.task.cancelling() <= self.base
