"""The engine probe: finds an engine that is dead, hung, or whose Ray cluster is gone.

Every ``probe_interval_s`` while READY, for each serving replica: the engine says it errored; the Ray cluster does not
answer a Ray call (a hung GCS: its port still accepts, so ``health.clusterwatch`` sees nothing;
reported as ``ClusterLost``); no token for ``hang_timeout_s`` while streams run (new arrivals cannot hide a
hang); or, idle, a one-token canary slower than ``probe_timeout_s``.
``probe_failure_threshold`` consecutive failures of a replica make one ``EngineFailed``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from supervisor import aio, logs
from supervisor.events import ClusterLost, EngineFailed
from supervisor.generation import Interrupted
from supervisor.states import State

if TYPE_CHECKING:
    from supervisor.daemon import Supervisor

log = logs.get_logger("vllm_supervisor.probe")


class EngineProbe:
    def __init__(self, sup: "Supervisor"):
        self.sup = sup
        self.last_s: float | None = None
        self.last_ok_wall: float | None = None
        self._reach_check: asyncio.Future | None = None

    @property
    def failures(self) -> int:
        """The most consecutive failures of any replica."""
        return max(r.probe_failures for r in self.sup.replicas)

    def status(self) -> dict[str, Any]:
        return {"consecutive_failures": self.failures, "last_duration_s": self.last_s,
                "last_success_unix": self.last_ok_wall}

    async def run(self) -> None:
        sup = self.sup
        while True:
            await asyncio.sleep(sup.cfg.probe_interval_s)
            for rep in sup.replicas:
                if sup.state is not State.READY or not rep.serving():
                    rep.probe_failures = 0  # a new generation starts with a clean slate
                    continue
                await self.probe(rep)

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
        now = time.monotonic()
        last_output = gen.last_output_monotonic
        if gen.pumps:
            stalled = now - max(last_output, min(start for start, _ in gen.pumps.values()))
            if stalled > cfg.hang_timeout_s:
                return f"no token for {stalled:.1f} s with {len(gen.pumps)} stream(s) running"
            return None
        if now - last_output < cfg.probe_interval_s:
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
