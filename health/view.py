"""What the detectors read of the daemon: narrow views that the owner implements
(``supervisor.detector_view``), so that ``health`` imports nothing above it. A detector
reports only by ``post``ing one of ``health.events``; the owner task decides what follows."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from config import SupervisorSettings
from health.events import ClusterLost, EngineFailed
from health.metrics import SupervisorMetrics


class ClusterView(Protocol):
    """The Ray cluster the daemon is connected to, and the owner task's queue."""

    @property
    def gcs_address(self) -> str: ...  # "" when there is none

    @property
    def agent_pid(self) -> int | None: ...  # the Ray agent now connected

    def post(self, event: EngineFailed | ClusterLost) -> None: ...


class WatchView(ClusterView, Protocol):
    """What ``health.clusterwatch.ClusterWatch`` reads."""

    @property
    def gcs_lost_after_s(self) -> float: ...

    @property
    def cluster_lost(self) -> bool: ...  # already reported and acted on: nothing to watch until it reconnects

    def agent_alive(self) -> bool: ...

    def terminal(self) -> bool: ...  # the daemon stopped or failed for good


class ProbeView(ClusterView, Protocol):
    """What ``health.probe.EngineProbe`` reads."""

    @property
    def cfg(self) -> SupervisorSettings: ...

    @property
    def replicas(self) -> Sequence[Any]: ...  # supervisor.replica.ReplicaView: the owner's latest snapshot

    @property
    def metrics(self) -> SupervisorMetrics: ...

    @property
    def released_monotonic(self) -> float: ...  # when the engines were last released from a pause or sleep

    def ready(self) -> bool: ...  # the daemon is READY

    def held(self) -> bool: ...  # the engines are paused or asleep on purpose

    def has_cluster(self) -> bool: ...  # Ray is used (a cluster to check)

    def reachable(self) -> bool: ...  # a Ray call answers (blocks: run it in a thread)

    async def canary(self, gen: Any) -> bool: ...  # one token on gen; False: gen was failed meanwhile
