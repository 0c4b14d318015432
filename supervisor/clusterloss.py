"""Loss of the Ray cluster and the wait for it to come back (a part the owner,
``supervisor.daemon.Supervisor``, builds; its task runs every method here).

A ``ClusterLost`` (``health.clusterwatch``, or the probe finding the GCS mute) kills the Ray
agent at once, before a new GCS can answer it (``executor.rayagent`` says why), forgets the
standby's workers (they went with the cluster) and fails every serving generation like any
fault. Every build then waits here, up to ``ray.reconnect_timeout_s``, for the GCS to listen
again and a new agent to connect (one replica reconnects; the others wait for it); past that
the recovery fails and the daemon exits 75.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from health.clusterwatch import listening, split_address
from supervisor import logs
from supervisor.events import ClusterLost, EngineFailed
from supervisor.owner import Owner
from supervisor.states import State

log = logs.get_logger("vllm_supervisor.clusterloss")


class ClusterLoss:
    def __init__(self, sup: Owner):
        self.sup = sup
        self.lost_monotonic: float | None = None  # when the GCS stopped answering (while lost)
        self._reconnecting = asyncio.Lock()

    def status(self) -> dict[str, Any]:
        ray, lost = self.sup.ray, self.lost_monotonic
        return {"gcs_address": ray.gcs_address, "connected": ray.cluster is not None and not ray.cluster_lost,
                "lost_for_s": None if lost is None else round(time.monotonic() - lost, 1),
                "agent_pid": ray.agent_pid}

    async def on_lost(self, event: ClusterLost) -> None:
        sup, ray = self.sup, self.sup.ray
        if (ray.cluster_lost or ray.cluster is None or sup.state.terminal
                or ray.released or (event.agent_pid is not None and event.agent_pid != ray.agent_pid)):
            return  # a repeat, or a report about an older agent
        being_built = [r.building for r in sup.replicas if r.building is not None]  # their engine cores lost it too
        timeout = ray.settings.reconnect_timeout_s  # the ray settings of the start (a reload's apply at the next)
        log.error("ray cluster lost", address=event.address, detail=event.detail, reconnect_timeout_s=timeout,
                  detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1))
        self.lost_monotonic = event.detected_monotonic
        sup.metrics.ray_connected.set(0)
        await asyncio.to_thread(ray.lose)
        await sup.standby.cluster_lost()
        sup.recovery.doom(being_built)
        reason = f"ray cluster lost ({event.address}: {event.detail}); waiting up to {timeout:g} s for it"
        for rep in sup.replicas:  # a recovery under way from a death the loss explains
            before = rep.record.reason if rep.record is not None else None
            if rep.record is not None and rep.record.add_cluster_lost(event.detected_monotonic, reason):
                log.info("failure cause refined", cause="ray_lost", replica=rep.index, refined_from=before)
        serving = [r.current for r in sup.replicas if r.serving()]
        for gen in serving:
            if sup.state is not State.STOPPING:
                sup.recovery.on_engine_failed(EngineFailed(gen.number, "ray_lost", reason, event.detected_monotonic))
        if not serving and sup.state is State.RECOVERING:
            sup.machine.transition(State.RECOVERING, reason)

    async def await_back(self) -> tuple[bool, str]:
        """Until the deadline: wait for the lost GCS to listen again (a private cluster is
        started anew at once), then connect a new agent. Returns (ok, detail)."""
        async with self._reconnecting:
            if not self.sup.ray.cluster_lost:
                return True, ""  # another replica reconnected it
            return await self._reconnect()

    async def _reconnect(self) -> tuple[bool, str]:
        sup, ray = self.sup, self.sup.ray
        timeout = ray.settings.reconnect_timeout_s
        lost_at = self.lost_monotonic or time.monotonic()
        private = ray.cluster.started_local
        # The configured host:port when there is one (a head that returns on a new IP behind a
        # name), else the address Ray reported (``auto``).
        configured = ray.settings.address
        address = configured if split_address(configured) else ray.gcs_address
        while time.monotonic() < lost_at + timeout:
            if sup.state is State.STOPPING:
                return True, "stopping"
            if private or await listening(address) is None:
                try:
                    await asyncio.to_thread(ray.connect)  # a new agent
                except Exception as exc:  # the GCS listens before its node is up: try again
                    log.warning("ray reconnect failed; retrying", error=f"{type(exc).__name__}: {exc}"[:300])
                    await asyncio.sleep(1.0)
                    continue
                lost_for = time.monotonic() - lost_at
                self.lost_monotonic = None
                sup.metrics.ray_connected.set(1)
                log.info("ray cluster back", address=ray.gcs_address, lost_for_s=round(lost_for, 2))
                if sup.state is State.RECOVERING:
                    sup.machine.transition(State.RECOVERING, f"ray cluster back after {lost_for:.1f} s; rebuilding")
                return True, ""
            await asyncio.sleep(0.5)
        return False, f"ray cluster at {address} lost and not back within {timeout:g} s"
