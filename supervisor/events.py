"""What the owner's dispatch (``supervisor.owner``) reacts to.

Inputs: signals, the executor's death reports, requests that see an engine die, the
detectors, the control socket only enqueue one of these (the failures the detectors report,
``EngineFailed`` and ``ClusterLost``, are ``health.events``).

Results: the slow work the owner starts (``supervisor.recovery``, ``supervisor.clusterloss``)
runs in tasks that post what came of it. A result nobody wants any more (a build of a
generation that failed meanwhile, a result after the stop's deadline) is dropped by the owner.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from health.events import ClusterLost, EngineFailed  # what the detectors report

# --- inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignalReceived:
    signum: int


@dataclass(frozen=True)
class ControlCommand:
    """From the control socket; the owner sets ``reply`` (a future) with the answer."""

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


# --- results of the owner's work ----------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """The model is there and Ray connected (the first start); ``error``: it could not."""

    error: str = ""


@dataclass(frozen=True)
class Placed:
    """A replica's placement step (backoff, the cluster's return, its placement group) ended."""

    replica: int
    error: str = ""  # it failed (``capacity``: no room for the group within its timeout)
    capacity: bool = False
    fatal: bool = False  # the Ray cluster did not come back in time: the daemon gives up
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildFinished:
    """The build of generation ``number`` for ``replica``: ``generation`` when it is up, else
    ``error`` (the task already cleaned up what the failed build left)."""

    replica: int
    number: int
    generation: Any = None  # supervisor.generation.Generation
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TeardownBegan:
    """The streams let go of ``number`` (or the drain's bound passed): its teardown begins now
    (a worker-death report detected after this is the teardown's own doing)."""

    replica: int
    number: int
    at_monotonic: float


@dataclass(frozen=True)
class TeardownFinished:
    replica: int
    number: int
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RetryDue:
    """A waiting replica's restart budget has room again."""

    replica: int


@dataclass(frozen=True)
class Drained:
    """In-flight requests finished, or the drain's bound passed; for ``purpose``: stop | rebuild."""

    purpose: str


@dataclass(frozen=True)
class StopDeadline:
    """The stop waited ``recovery_timeout_s`` for work under way: it stops without it."""


@dataclass(frozen=True)
class ClusterBack:
    """A new Ray agent connected after the cluster was lost."""

    lost_for_s: float


@dataclass(frozen=True)
class StopFinished:
    pass


Event = (SignalReceived | EngineFailed | ClusterLost | ControlCommand | ReloadRequested | Quarantined | Prepared
         | Placed | BuildFinished | TeardownBegan | TeardownFinished | RetryDue | Drained | StopDeadline | ClusterBack
         | StopFinished)
