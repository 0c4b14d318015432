"""The daemon as its detectors see it: ``health.view``'s protocols over the Ray link, the
owner's latest snapshot and the queue, so that ``health`` never imports ``supervisor``.

Every member is read when asked, never copied: a reload replaces the settings, and each event
the owner takes may publish a new snapshot."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from config import SupervisorSettings
from health.events import ClusterLost, EngineFailed
from health.metrics import SupervisorMetrics
from supervisor.generation import Generation, Interrupted
from supervisor.raylink import RayLink
from supervisor.replica import ReplicaView
from supervisor.snapshot import Snapshot
from supervisor.states import State


class DetectorView:
    """Implements ``health.view.ProbeView`` and ``health.view.WatchView``."""

    def __init__(self, ray: RayLink, snapshot: Callable[[], Snapshot], cfg: Callable[[], SupervisorSettings],
                 post: Callable[[EngineFailed | ClusterLost], None], metrics: SupervisorMetrics, client: Any):
        """``client``: the request path (``supervisor.engine_client``): holds, and the canary."""
        self._ray, self._snapshot, self._cfg, self._post, self._metrics, self._client = (
            ray, snapshot, cfg, post, metrics, client)

    def post(self, event: EngineFailed | ClusterLost) -> None:
        self._post(event)

    # --- the Ray cluster ---

    @property
    def gcs_address(self) -> str:
        return self._ray.gcs_address

    @property
    def agent_pid(self) -> int | None:
        return self._ray.agent_pid

    @property
    def cluster_lost(self) -> bool:
        return self._ray.cluster_lost

    def agent_alive(self) -> bool:
        return self._ray.agent_alive()

    def has_cluster(self) -> bool:
        return self._ray.cluster is not None

    def reachable(self) -> bool:
        return self._ray.reachable()

    @property
    def gcs_lost_after_s(self) -> float:
        return self._ray.settings.gcs_lost_after_s  # the start's (ray settings apply at the next start)

    # --- the daemon and its engines ---

    def ready(self) -> bool:
        return self._snapshot().state is State.READY

    def terminal(self) -> bool:
        return self._snapshot().state.terminal

    @property
    def cfg(self) -> SupervisorSettings:
        return self._cfg()

    @property
    def replicas(self) -> Sequence[ReplicaView]:
        return self._snapshot().replicas

    @property
    def metrics(self) -> SupervisorMetrics:
        return self._metrics

    def held(self) -> bool:
        return bool(self._client.holds)

    @property
    def released_monotonic(self) -> float:
        return self._client.released_monotonic

    async def canary(self, gen: Generation) -> bool:
        try:
            await self._client.canary(gen)
        except Interrupted:  # the owner failed gen while the canary ran
            return False
        return True
