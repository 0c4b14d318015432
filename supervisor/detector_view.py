"""The daemon as its detectors see it: ``health.view``'s protocols implemented over the
``Supervisor``, so that ``health`` never imports ``supervisor``.

Every member is read from the owner when asked, never copied: a reload replaces ``cfg`` and
``settings``, and a test may replace ``post``."""

from __future__ import annotations

from typing import Any, Sequence

from config import SupervisorSettings
from health.events import ClusterLost, EngineFailed
from health.metrics import SupervisorMetrics
from supervisor.generation import Generation, Interrupted
from supervisor.replica import Replica
from supervisor.states import State


class DetectorView:
    """Implements ``health.view.ProbeView`` and ``health.view.WatchView``."""

    def __init__(self, owner: Any):  # supervisor.daemon.Supervisor (not imported: it imports this module)
        self._owner = owner

    def post(self, event: EngineFailed | ClusterLost) -> None:
        self._owner.post(event)

    # --- the Ray cluster ---

    @property
    def gcs_address(self) -> str:
        return self._owner.ray.gcs_address

    @property
    def agent_pid(self) -> int | None:
        return self._owner.ray.agent_pid

    @property
    def cluster_lost(self) -> bool:
        return self._owner.ray.cluster_lost

    def agent_alive(self) -> bool:
        return self._owner.ray.agent_alive()

    def has_cluster(self) -> bool:
        return self._owner.ray.cluster is not None

    def reachable(self) -> bool:
        return self._owner.ray.reachable()

    @property
    def gcs_lost_after_s(self) -> float:
        return self._owner.ray.settings.gcs_lost_after_s  # the start's (ray settings apply at the next start)

    # --- the daemon and its engines ---

    def ready(self) -> bool:
        return self._owner.state is State.READY

    def terminal(self) -> bool:
        return self._owner.state.terminal

    @property
    def cfg(self) -> SupervisorSettings:
        return self._owner.cfg

    @property
    def replicas(self) -> Sequence[Replica]:
        return self._owner.replicas

    @property
    def metrics(self) -> SupervisorMetrics:
        return self._owner.metrics

    def held(self) -> bool:
        return bool(self._owner.client.holds)

    @property
    def released_monotonic(self) -> float:
        return self._owner.client.released_monotonic

    async def canary(self, gen: Generation) -> bool:
        try:
            await self._owner.client.canary(gen)
        except Interrupted:  # the owner failed gen while the canary ran
            return False
        return True
