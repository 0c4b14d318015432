"""Loss of the Ray cluster and the wait for it to come back: the slow work the owner
(``supervisor.owner``) starts when its dispatch takes a ``ClusterLost``.

The dispatch marks the link lost at once (``RayLink.mark_lost``: nothing more is asked of
the agent) and fails every serving generation like any fault; ``lose`` then kills the Ray
agent, before a new GCS can answer it (``executor.rayagent`` says why), and forgets the
standby's workers (they went with the cluster). Every build waits in ``await_back``, up to
``ray.reconnect_timeout_s``, for the GCS to listen again and a new agent to connect (one
replica reconnects; the others wait for it), and posts ``ClusterBack``; past that the build's
placement fails for good and the daemon exits 75.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from health.clusterwatch import listening, split_address
from health.metrics import SupervisorMetrics
from supervisor import logs
from supervisor.events import ClusterBack, Event
from supervisor.raylink import RayLink
from supervisor.standby import Standby

log = logs.get_logger("vllm_supervisor.clusterloss")


class ClusterLoss:
    def __init__(self, ray: RayLink, standby: Standby, post: Callable[[Event], None], metrics: SupervisorMetrics,
                 stopping: Callable[[], bool]):
        self.ray, self.standby, self.post, self.metrics, self.stopping = ray, standby, post, metrics, stopping
        self.lost_monotonic: float | None = None  # when the GCS stopped answering (while lost)
        self._reconnecting = asyncio.Lock()

    def status(self) -> dict[str, Any]:
        ray, lost = self.ray, self.lost_monotonic
        return {"gcs_address": ray.gcs_address, "connected": ray.cluster is not None and not ray.cluster_lost,
                "lost_for_s": None if lost is None else round(time.monotonic() - lost, 1),
                "agent_pid": ray.agent_pid}

    async def lose(self, detected_monotonic: float) -> None:
        """Kill the lost cluster's agent and forget the standby's workers (the link is already
        marked lost: ``RayLink.mark_lost``)."""
        self.lost_monotonic = detected_monotonic
        self.metrics.ray_connected.set(0)
        await asyncio.to_thread(self.ray.kill_agent)
        await self.standby.cluster_lost()

    async def await_back(self) -> tuple[bool, str]:
        """Until the deadline: wait for the lost GCS to listen again (a private cluster is
        started anew at once), then connect a new agent. Returns (ok, detail)."""
        async with self._reconnecting:
            if not self.ray.cluster_lost:
                return True, ""  # another replica reconnected it
            return await self._reconnect()

    async def _reconnect(self) -> tuple[bool, str]:
        ray = self.ray
        timeout = ray.settings.reconnect_timeout_s
        lost_at = self.lost_monotonic or time.monotonic()
        private = ray.cluster.started_local
        # The configured host:port when there is one (a head that returns on a new IP behind a
        # name), else the address Ray reported (``auto``).
        configured = ray.settings.address
        address = configured if split_address(configured) else ray.gcs_address
        while time.monotonic() < lost_at + timeout:
            if self.stopping():
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
                self.metrics.ray_connected.set(1)
                log.info("ray cluster back", address=ray.gcs_address, lost_for_s=round(lost_for, 2))
                self.post(ClusterBack(lost_for))
                return True, ""
            await asyncio.sleep(0.5)
        return False, f"ray cluster at {address} lost and not back within {timeout:g} s"
