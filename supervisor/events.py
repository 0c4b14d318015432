"""What the owner task reacts to. Everything else (signals, the executor's death reports,
requests that see an engine die, the probe, the control socket) only enqueues one of these.
The failures the detectors report (``EngineFailed``, ``ClusterLost``) are ``health.events``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from health.events import ClusterLost, EngineFailed  # what the detectors report


@dataclass(frozen=True)
class SignalReceived:
    signum: int


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


@dataclass(frozen=True)
class Quarantined:
    """A request crashed two engines (``supervisor.suspects``): its input is refused from now on."""

    replica: int
    generations: tuple[int, ...]
    request_id: str
    fingerprint: str


Event = (SignalReceived | EngineFailed | ClusterLost | RecoveryFinished | StopFinished | ControlCommand | ReloadRequested
         | Quarantined)
