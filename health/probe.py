"""The engine probe: finds an engine that is dead, hung, or whose Ray cluster is gone.

A hung busy engine: every ``STALL_CHECK_S`` while READY, a replica with streams running whose
engine took no step for ``hang_timeout_s`` (since the oldest stream began, so new arrivals cannot
hide a hang) and still none ``CONFIRM_S`` later is hung (one ``EngineFailed``, no threshold). The clock is the engine's own steps
(``executor.steps``): each chunk of a chunked prefill is one, so a long prompt is progress
although no token comes out for a long time; an engine that reports no steps (vLLM's stats off)
is judged by its tokens. The idle canary is a stream too: a hung idle engine is found
``hang_timeout_s`` after the canary that finds it was sent ("… with the idle canary running"),
sooner than its timeout with the defaults. While the engines are held on purpose (vLLM's
``pause_generation``, ``sleep``: ``/pause``, ``/sleep``) nothing is checked, and the wait of a
stream is counted from the release.

Every ``probe_interval_s`` while READY, for each serving replica: the engine says it errored; the
Ray cluster does not answer a Ray call (a hung GCS: its port still accepts, so
``health.clusterwatch`` sees nothing; reported as ``ClusterLost``); or, idle for
``canary_interval_s``, a one-token canary slower than ``probe_timeout_s`` (an idle engine costs
nothing between canaries: a canary step does not leave the workers spinning, ``executor.canary``;
a request that finds a hung idle engine is a busy engine's case, found after ``hang_timeout_s``).
``probe_failure_threshold`` consecutive failures of a replica make one ``EngineFailed``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from executor.canary import CANARY_PREFIX
from supervisor import aio, logs
from supervisor.events import ClusterLost, EngineFailed
from supervisor.generation import Interrupted
from supervisor.states import State

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor

log = logs.get_logger("vllm_supervisor.probe")

STALL_CHECK_S = 0.5  # how often a busy engine's step clock is read (a float compare per replica)
CONFIRM_S = 0.2  # a stall is read again this much later before it is a hang


def stalled(gen: Any, hang_timeout_s: float, now: float | None = None, since: float = 0.0) -> str | None:
    """Why a busy generation is hung (its streams waited ``hang_timeout_s`` on no engine step
    since ``since``, when the engines were last released from a pause or sleep), or None:
    idle, or still moving."""
    if not gen.pumps:
        return None
    now = time.monotonic() if now is None else now
    oldest = min(start for start, _ in gen.pumps.values())
    waited = now - max(gen.last_progress(), oldest, since)
    if waited <= hang_timeout_s:
        return None
    clock = "engine step" if gen.steps is not None and gen.steps.ticking else "token"
    running = (f"{len(gen.pumps)} stream(s) running" if any(not _is_canary(t) for t in gen.pumps)
               else "the idle canary running")
    return (f"no {clock} for {waited:.1f} s with {running} "
            f"(last token {now - max(gen.last_output_monotonic, oldest):.1f} s ago)")


def _is_canary(task: Any) -> bool:
    name = task.get_name() if hasattr(task, "get_name") else ""
    return name.startswith(CANARY_PREFIX)


class EngineProbe:
    def __init__(self, sup: "Supervisor"):
        self.sup = sup
        self.last_s: float | None = None
        self.last_ok_wall: float | None = None
        self._reach_check: asyncio.Future | None = None
        self._probes: dict[int, asyncio.Task] = {}  # replica index -> its full probe in flight

    @property
    def failures(self) -> int:
        """The most consecutive failures of any replica."""
        return max(r.probe_failures for r in self.sup.replicas)

    def status(self) -> dict[str, Any]:
        return {"consecutive_failures": self.failures, "last_duration_s": self.last_s,
                "last_success_unix": self.last_ok_wall}

    async def run(self) -> None:
        try:
            await self._loop()
        finally:
            for task in self._probes.values():
                task.cancel()

    async def _loop(self) -> None:
        sup = self.sup
        next_probe = time.monotonic() + sup.cfg.probe_interval_s
        while True:
            await asyncio.sleep(min(STALL_CHECK_S, sup.cfg.probe_interval_s))
            probe_now = time.monotonic() >= next_probe
            if probe_now:
                next_probe = time.monotonic() + sup.cfg.probe_interval_s
            client = sup.client
            for rep in sup.replicas:
                if sup.state is not State.READY or not rep.serving() or client.holds:
                    # a new generation starts with a clean slate; a paused or sleeping engine
                    # (vLLM's pause_generation / sleep) is still on purpose, and so is its canary
                    rep.probe_failures = 0
                    continue
                gen = rep.current
                if stalled(gen, sup.cfg.hang_timeout_s, since=client.released_monotonic) is not None:
                    # Once more after the loop ran a while: a daemon loop that was itself held up
                    # has step reports queued for it, which must be read before anything is hung.
                    await asyncio.sleep(CONFIRM_S)
                    problem = None if client.holds else stalled(gen, sup.cfg.hang_timeout_s, since=client.released_monotonic)
                    if problem is not None and not gen.failed and gen is rep.current and sup.state is State.READY:
                        rep.probe_failures = 0  # the wait is itself the evidence: no threshold
                        log.warning("probe failed", problem=problem, replica=rep.index)
                        sup.post(EngineFailed(gen.number, "hang", problem, kill_workers=True))
                    continue
                if probe_now and (rep.index not in self._probes or self._probes[rep.index].done()):
                    # the replicas' probes run side by side, and beside the stall checks: a hung
                    # replica's canary delays nothing
                    self._probes[rep.index] = asyncio.ensure_future(self.probe(rep))

    async def probe(self, rep: Any) -> None:
        sup, gen = self.sup, rep.current
        try:
            problem = await self.check(gen)
        except Exception as exc:
            problem = f"probe error: {type(exc).__name__}: {exc}"
        if problem is None:
            rep.probe_failures = 0
            return
        if problem.startswith("dead:"):
            rep.probe_failures = 0
            sup.post(EngineFailed(gen.number, "engine_dead", problem))
            return
        rep.probe_failures += 1
        log.warning("probe failed", problem=problem, consecutive=rep.probe_failures, replica=rep.index)
        if rep.probe_failures >= sup.cfg.probe_failure_threshold and gen is rep.current and not gen.failed:
            rep.probe_failures = 0
            if problem.startswith("ray cluster"):  # a GCS that accepts but does not answer: lost too
                sup.post(ClusterLost(sup.builder.gcs_address, problem, agent_pid=sup.builder.agent_pid))
            else:
                sup.post(EngineFailed(gen.number, "hang", problem, kill_workers=True))

    async def check(self, gen: Any) -> str | None:
        sup, cfg = self.sup, self.sup.cfg
        if gen.engine.errored:
            return "dead: engine reported errored"
        if sup.builder.cluster is not None:
            # At most one check in flight: a GCS that is gone can block the call for a minute.
            if self._reach_check is None or self._reach_check.done():
                self._reach_check = asyncio.ensure_future(asyncio.to_thread(sup.builder.reachable))
            try:
                reachable = await aio.wait_for(asyncio.shield(self._reach_check), cfg.probe_timeout_s)
            except asyncio.TimeoutError:
                reachable = False
            if not reachable:
                return "ray cluster unreachable"
        if gen.pumps:  # busy: judged by its step clock (``stalled``, in ``run``)
            return None
        if time.monotonic() - gen.last_progress() < cfg.canary_interval_s:
            return None
        started = time.monotonic()
        try:
            async with asyncio.timeout(cfg.probe_timeout_s):
                await sup.client.canary(gen)
        except TimeoutError:
            return f"canary generation took longer than {cfg.probe_timeout_s:g} s"
        except Interrupted:
            return None
        self.last_s = time.monotonic() - started
        self.last_ok_wall = time.time()
        sup.metrics.probe_latency.labels(str(gen.replica)).observe(self.last_s)
        sup.metrics.probe_last_success.labels(str(gen.replica)).set(self.last_ok_wall)
        return None
