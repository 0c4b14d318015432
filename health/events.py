"""What the detectors report: the failures ``health`` finds, posted to the daemon's owner task.

The owner's other events (``supervisor.events``) are its own business; it posts these two as
well, for failures it finds itself (a failed build, an operator's restart, a reload)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineFailed:
    """Any failure source: worker death, engine dead, probe failure."""

    generation: int
    reason: str  # worker_death | engine_dead | hang | ray_lost | build_failed | operator | reload
    detail: str
    detected_monotonic: float = field(default_factory=time.monotonic)
    kill_workers: bool = False  # a hang: kill the stuck workers before tearing down
    ranks: tuple[int, ...] = ()  # dead worker ranks, when known


@dataclass(frozen=True)
class ClusterLost:
    """The Ray cluster's GCS stopped listening (``health.clusterwatch``)."""

    address: str
    detail: str
    detected_monotonic: float = field(default_factory=time.monotonic)
    agent_pid: int | None = None  # the Ray agent that lost it (a report about an older agent is ignored)
