"""What the owner task reacts to. Everything else (signals, the executor's death reports,
requests that see an engine die, the probe, the control socket) only enqueues one of these."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SignalReceived:
    signum: int


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


@dataclass(frozen=True)
class RecoveryFinished:
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class StopFinished:
    pass


@dataclass(frozen=True)
class ControlCommand:
    """From the control socket; the owner task sets ``reply`` (a future) with the answer."""

    cmd: str
    args: dict
    reply: asyncio.Future


@dataclass(frozen=True)
class ReloadRequested:
    pass


Event = SignalReceived | EngineFailed | ClusterLost | RecoveryFinished | StopFinished | ControlCommand | ReloadRequested
