"""One engine generation and the errors a request sees when no engine can finish it."""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from vllm.exceptions import GracefulHTTPError


class Interrupted(Exception):
    """The request's engine generation was declared failed while it was running."""


class EngineUnavailable(GracefulHTTPError):
    """No engine can take the request now: HTTP 503 (``Retry-After`` is added by the front,
    from the daemon's state)."""

    def __init__(self, reason: str):
        super().__init__(reason, HTTPStatus.SERVICE_UNAVAILABLE)


class RequestFailed(GracefulHTTPError):
    """A request that was in flight cannot be finished; the client should retry it (503)."""

    def __init__(self, message: str):
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE)


class QueryOfDeath(GracefulHTTPError):
    """The request crashed two engines, or is the same input as one that did
    (``supervisor.suspects``): a final error, 422, which clients and SDKs do not retry (a 503
    would make them send the poison again)."""

    def __init__(self, message: str):
        super().__init__(message, HTTPStatus.UNPROCESSABLE_ENTITY)


@dataclass
class Generation:
    """One engine and what it owns."""

    number: int
    instance_id: str
    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    shm_before: set[str]
    build_s: float
    # each engine stream's reader (supervisor.stream.Reader)
    readers: set[Any] = field(default_factory=set)
    # what is still inside AsyncLLM.generate's abort of this engine (a dead one may never
    # answer): interrupted readers, and the closes of streams their readers left
    lingering: set[Any] = field(default_factory=set)
    failed: bool = False
    planned: bool = False  # retired by a drain-then-rebuild (restart, reload), not by a fault
    standby: dict[str, Any] | None = None  # what its build adopted (supervisor.standby)
    held_as: tuple[Any, Any] = (None, None)  # what its engine was given: (asleep, paused) (engine_client.hold_like_the_others)
    replica: int = 0  # the replica it serves (supervisor.replica)
    epoch: int = 0  # the engine arguments it was built with (EngineBuilder.config_epoch: +1 per reload that changed them)
    last_output_monotonic: float = field(default_factory=time.monotonic)  # its last token
    steps: Any = None  # executor.steps.StepClock: its last engine step (the probe's hang check)
    # its engine core and workers on this host, (pid, start time): the probe reads whether they
    # starve (health.starvation); a pid reused since by another process is not read
    local_procs: list[tuple[int, int | None]] = field(default_factory=list)
    # its first ``first_steps`` steps are judged by ``first_steps_timeout_s`` (a kernel compiled
    # on first use runs inside a step; ``SupervisorSettings.first_steps_timeout``)
    first_steps: int = 0
    first_steps_timeout_s: float = 0.0
    # the choices in flight on it (choice id -> its Carryover), and what its failure says of them
    choices: dict[str, Any] = field(default_factory=dict)
    took_continued: bool = False  # a choice continued after a failure joined it
    _verdict: Any = None

    def failure_verdict(self) -> Any:
        """What this generation's failure says about the choices in flight on it
        (``supervisor.suspects.verdict``), taken once, by the first choice that saw it fail. A
        planned rebuild (restart, reload) is no failure: it counts for nobody."""
        if self._verdict is None:
            from supervisor.suspects import Verdict, verdict

            self._verdict = (Verdict(frozenset(), plain=False) if self.planned else verdict(
                {c: r.suspect.outputs_here for c, r in self.choices.items()},
                [c for c, r in self.choices.items() if r.suspect.on_probation]))
        return self._verdict

    def hang_timeout(self, steady_s: float) -> float:
        """How long this generation may take no step, busy, before it is hung: ``steady_s``
        once it has taken ``first_steps`` steps (or when it has no step clock: the test hook's
        token clock), longer before."""
        taken = self.steps.steps if self.steps is not None else self.first_steps
        return max(steady_s, self.first_steps_timeout_s) if taken < self.first_steps else steady_s

    def last_progress(self) -> float:
        """When the engine last moved (``time.monotonic()``): its last step, or its last token
        when it reports no steps (vLLM's stats off)."""
        stepped = self.steps.last_monotonic if self.steps is not None and self.steps.ticking else 0.0
        return max(self.last_output_monotonic, stepped)

    async def reap_lingering(self, timeout_s: float = 2.0) -> None:
        """After shutdown: a second cancel ends an abort that the dead engine never answers
        (each such wait holds the old engine, its zmq sockets and threads). Each leaves the
        set itself when it is out."""
        for waiter in list(self.lingering):
            waiter.cancel()
        deadline = time.monotonic() + timeout_s
        while self.lingering and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def release(self) -> float:
        """Drop the torn-down engine and collect it now; returns the seconds that took.

        An ``AsyncLLM`` sits in reference cycles with its zmq context (two I/O threads and a
        reaper), sockets and queues; left to the cyclic GC it goes whenever a full collection
        happens to run, so threads and fds drift up over recoveries. One collection per
        recovery (a rare event) returns them at once."""
        self.engine = None
        self.readers.clear()
        self.choices.clear()
        started = time.monotonic()
        gc.collect()
        return time.monotonic() - started

    def interrupt_streams(self) -> None:
        """Park every request of this generation now (``supervisor.stream.Reader``): each
        reader is marked, and vLLM wakes those waiting on the engine with its own
        engine-dead error (``executor.engine.wake_streams_dead``: no abort of the request,
        which a dead engine may never answer). A reader still waiting after that (inside
        vLLM's ``add_request``, not yet listed with the engine) has its wait cancelled and
        lingers until it is out of vLLM's abort; one between outputs stops before it reads
        again."""
        from executor.engine import wake_streams_dead

        readers = list(self.readers)
        if not readers:
            return
        for reader in readers:
            reader.interrupted = True
        if self.engine is not None:
            try:
                wake_streams_dead(self.engine)
            except Exception:  # noqa: BLE001 (the cancel below still parks every reader)
                pass
        # after the readers just woken have run: each of those has let go of its wait
        asyncio.get_running_loop().call_soon(self._cancel_waiting, readers)

    def _cancel_waiting(self, readers: list[Any]) -> None:
        for reader in readers:
            if reader.cancel():
                self.lingering.add(reader)


def is_engine_death(exc: BaseException, gen: Generation) -> bool:
    """An error that means the engine (not the request) failed."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError) or bool(gen.engine.errored)
