"""The engine probe: finds an engine that is dead, hung, or whose Ray cluster is gone.

A hung busy engine: every ``STALL_CHECK_S`` while READY, a replica with streams running whose
engine took no step for ``hang_timeout_s`` (since the oldest stream began, so new arrivals cannot
hide a hang) and still none ``CONFIRM_S`` later is hung (one ``EngineFailed``, no threshold). The clock is the engine's own steps
(``executor.steps``): each chunk of a chunked prefill is one, so a long prompt is progress
although no token comes out for a long time; an engine that reports no steps (vLLM's stats off)
is judged by its tokens. A new generation's first ``hang_first_steps`` steps get
``hang_first_steps_timeout_s`` instead (90 s on a GPU: a kernel compiled on its first use runs
inside a step; no grace on CPU by default). The idle canary is a stream too: a hung idle engine is found
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

The probe sees the daemon only through ``health.view.ProbeView``, and reports by posting.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from executor.canary import CANARY_PREFIX
from health.events import ClusterLost, EngineFailed
from health.starvation import SPIN_S, STARVED_SHARE, Episodes, Window, sample, window
from health.view import ProbeView

log = structlog.get_logger("vllm_supervisor.probe")

STALL_CHECK_S = 0.5  # how often a busy engine's step clock is read (a float compare per replica)
CONFIRM_S = 0.2  # a stall is read again this much later before it is a hang


def stalled(gen: Any, hang_timeout_s: float, now: float | None = None, since: float = 0.0) -> str | None:
    """Why a busy generation is hung (its streams waited ``hang_timeout_s`` on no engine step
    since ``since``, when the engines were last released from a pause or sleep), or None:
    idle, or still moving."""
    waits = [r.since for r in gen.readers if r.waiting]  # a reader on its client is not waiting on the engine
    if not waits:
        return None
    now = time.monotonic() if now is None else now
    oldest = min(waits)
    waited = now - max(gen.last_progress(), oldest, since)
    if waited <= gen.hang_timeout(hang_timeout_s):  # longer for a new generation's first steps
        return None
    clock = "engine step" if gen.steps is not None and gen.steps.ticking else "token"
    running = (f"{len(gen.readers)} stream(s) running" if any(not _is_canary(t) for t in gen.readers)
               else "the idle canary running")
    return (f"no {clock} for {waited:.1f} s with {running} "
            f"(last token {now - max(gen.last_output_monotonic, oldest):.1f} s ago)")


def _is_canary(task: Any) -> bool:
    name = task.get_name() if hasattr(task, "get_name") else ""
    return name.startswith(CANARY_PREFIX)


class EngineProbe:
    def __init__(self, view: ProbeView):
        self.view = view
        self.last_s: float | None = None
        self.last_ok_wall: float | None = None
        self._reach_check: asyncio.Future | None = None
        self._probes: dict[int, asyncio.Task] = {}  # replica index -> its full probe in flight
        self.counts: dict[int, int] = {}  # replica index -> its consecutive failed probes
        self.starvation = Episodes(count_cap_s=STALL_CHECK_S + CONFIRM_S)  # stalled engines starved of CPU

    @property
    def failures(self) -> int:
        """The most consecutive failures of any replica."""
        return max(self.counts.values(), default=0)

    def passed(self, replica: int) -> bool:
        """Whether ``replica``'s last probe passed (or none failed since it came up)."""
        return self.counts.get(replica, 0) == 0

    def _current(self, replica: int) -> Any:
        """``replica``'s generation in the owner's latest snapshot (read again after each await)."""
        return self.view.replicas[replica].current
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
        view = self.view
        next_probe = time.monotonic() + view.cfg.probe_interval_s
        while True:
            await asyncio.sleep(min(STALL_CHECK_S, view.cfg.probe_interval_s))
            probe_now = time.monotonic() >= next_probe
            if probe_now:
                next_probe = time.monotonic() + view.cfg.probe_interval_s
            for rep in view.replicas:
                if not view.ready() or not rep.serving() or view.held():
                    # a new generation starts with a clean slate; a paused or sleeping engine
                    # (vLLM's pause_generation / sleep) is still on purpose, and so is its canary
                    self.counts[rep.index] = 0
                    continue
                gen = rep.current
                starved_s = self.starvation.moved(rep.index, gen.number, gen.last_progress())
                if starved_s is not None:
                    log.info("engine moved again after starving", replica=rep.index, starved_s=round(starved_s, 1))
                if stalled(gen, view.cfg.hang_timeout_s, since=view.released_monotonic) is not None:
                    problem, threads = await self._confirm(rep.index, gen)
                    if problem is not None:
                        described = threads.describe()
                        note = self._starved(rep.index, gen, threads.starved_share, threads=described)
                        if note is None:
                            continue  # starved of CPU (or just now): not hung (yet)
                        problem += note or f"; {described}"
                        self.counts[rep.index] = 0  # the wait is itself the evidence: no threshold
                        log.warning("probe failed", problem=problem, replica=rep.index)
                        view.post(EngineFailed(gen.number, "hang", problem, kill_workers=True))
                    continue
                if probe_now and (rep.index not in self._probes or self._probes[rep.index].done()):
                    # the replicas' probes run side by side, and beside the stall checks: a hung
                    # replica's canary delays nothing
                    self._probes[rep.index] = asyncio.ensure_future(self.probe(rep))

    async def _confirm(self, replica: int, gen: Any) -> tuple[str | None, Window | None]:
        """A stall read again ``CONFIRM_S`` later (a daemon loop that was itself held up has step
        reports queued for it, which must be read before anything is hung), with what the
        engine's threads did meanwhile (``health.starvation``): read once more ``SPIN_S`` on when
        that was ambiguous. (None, None): no longer stalled, or no longer this replica's to judge."""
        view = self.view
        for look in range(2):
            if look:
                await asyncio.sleep(SPIN_S)
            before = await asyncio.to_thread(sample, gen.local_procs)
            await asyncio.sleep(CONFIRM_S)
            problem = None if view.held() else stalled(gen, view.cfg.hang_timeout_s, since=view.released_monotonic)
            if problem is None or gen.failed or gen is not self._current(replica) or not view.ready():
                return None, None
            threads = window(before, await asyncio.to_thread(sample, gen.local_procs))
            if not threads.ambiguous or look:
                break
            log.info("engine busy while one of its threads waited for a CPU: read again", replica=replica,
                     after_s=SPIN_S, threads=threads.describe())
        return problem, threads

    def _starved(self, replica: int, gen: Any, share: float, now: float | None = None, threads: str = "") -> str | None:
        """Whether a stalled ``gen`` is starved of CPU rather than hung (``health.starvation``):
        a thread of its waited runnable for ``share`` of the confirmation while the engine
        barely ran. None: its verdict waits, while it is starved (for ``hang_starved_grace_s``
        at most, counted on a metric) and for ``hang_timeout_s`` after it was last seen starved
        (given its CPU back, it finishes the step it was kept from); else what the hang's detail
        adds ("" for a plain hang)."""
        cfg = self.view.cfg
        now = time.monotonic() if now is None else now
        if share >= STARVED_SHARE and cfg.hang_starved_grace_s > 0:
            starved_s, count_s = self.starvation.seen(replica, gen.number, now, CONFIRM_S)
            self.view.metrics.starved_seconds.labels(str(replica)).inc(count_s)
            if starved_s == 0.0:
                log.warning("engine starved of CPU: its hang verdict waits", replica=replica,
                            cpu_wait_share=round(share, 2), grace_s=cfg.hang_starved_grace_s, threads=threads)
            if starved_s < cfg.hang_starved_grace_s:
                return None
            log.warning("engine starved of CPU past its grace: judged hung", replica=replica, starved_s=round(starved_s, 1))
            return f"; its threads starved of CPU for {starved_s:.0f} s, past hang_starved_grace_s"
        last = self.starvation.last_seen(replica, gen.number)
        if not last:
            return ""
        if now - last < cfg.hang_timeout_s:
            return None
        return f"; {now - last:.1f} s after its threads were last seen starved of CPU"

    async def probe(self, rep: Any) -> None:
        view, gen = self.view, rep.current
        try:
            problem = await self.check(gen)
        except Exception as exc:
            problem = f"probe error: {type(exc).__name__}: {exc}"
        if problem is None:
            self.counts[rep.index] = 0
            return
        if problem.startswith("dead:"):
            self.counts[rep.index] = 0
            view.post(EngineFailed(gen.number, "engine_dead", problem))
            return
        failures = self.counts[rep.index] = self.counts.get(rep.index, 0) + 1
        log.warning("probe failed", problem=problem, consecutive=failures, replica=rep.index)
        if failures >= view.cfg.probe_failure_threshold and gen is self._current(rep.index) and not gen.failed:
            self.counts[rep.index] = 0
            if problem.startswith("ray cluster"):  # a GCS that accepts but does not answer: lost too
                view.post(ClusterLost(view.gcs_address, problem, agent_pid=view.agent_pid))
            else:
                view.post(EngineFailed(gen.number, "hang", problem, kill_workers=True))

    async def check(self, gen: Any) -> str | None:
        view, cfg = self.view, self.view.cfg
        if gen.engine.errored:
            return "dead: engine reported errored"
        if view.has_cluster():
            # At most one check in flight: a GCS that is gone can block the call for a minute.
            if self._reach_check is None or self._reach_check.done():
                self._reach_check = asyncio.ensure_future(asyncio.to_thread(view.reachable))
            try:
                async with asyncio.timeout(cfg.probe_timeout_s):  # not asyncio.wait_for: supervisor.aio says why
                    reachable = await asyncio.shield(self._reach_check)
            except TimeoutError:
                reachable = False
            if not reachable:
                return "ray cluster unreachable"
        if gen.readers:  # busy: judged by its step clock (``stalled``, in ``run``)
            return None
        if time.monotonic() - gen.last_progress() < cfg.canary_interval_s:
            return None
        started = time.monotonic()
        try:
            async with asyncio.timeout(cfg.probe_timeout_s):
                finished = await view.canary(gen)
        except TimeoutError:
            return f"canary generation took longer than {cfg.probe_timeout_s:g} s"
        if not finished:  # its generation was failed meanwhile: nothing to judge, nothing to record
            return None
        self.last_s = time.monotonic() - started
        self.last_ok_wall = time.time()
        view.metrics.probe_latency.labels(str(gen.replica)).observe(self.last_s)
        view.metrics.probe_last_success.labels(str(gen.replica)).set(self.last_ok_wall)
        return None
