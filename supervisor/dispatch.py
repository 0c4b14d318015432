"""What the request path sees of the daemon: a ``Dispatcher`` protocol, and readiness.

The request path (``supervisor.engine_client``, ``supervisor.stream``, ``supervisor.admission``)
and the HTTP front depend on this view, not on the lifecycle owner
(``supervisor.daemon.Supervisor``, which implements it): the daemon's state and why, which
generation a request goes to now, the serving replicas, the "something changed" event, the
settings they read, the inputs in quarantine, and the three reports a request makes (its
outcome; an engine it saw die; a request that crashed two engines).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from supervisor.states import State

if TYPE_CHECKING:
    from config.settings import SupervisorSettings
    from health.metrics import SupervisorMetrics
    from supervisor.generation import Generation
    from supervisor.events import Quarantined
    from supervisor.replica import ReplicaView
    from supervisor.suspects import Quarantine


class Dispatcher(Protocol):
    """The daemon as the request path sees it (read-only, but for the three reports)."""

    @property
    def state(self) -> State: ...

    @property
    def reason(self) -> str:
        """Why the daemon is in ``state`` (said in every 503)."""

    @property
    def cfg(self) -> SupervisorSettings: ...

    @property
    def replicas(self) -> Sequence[ReplicaView]:
        """The replicas in the owner's latest snapshot."""

    @property
    def changed(self) -> asyncio.Event:
        """Pulsed on every transition: admission and held streams wait on it."""

    @property
    def metrics(self) -> SupervisorMetrics: ...

    def pick(self, not_gens: tuple[Generation, ...] = (), parked: bool = False,
             token_ids: Any = None, replica: int | None = None) -> Generation | None:
        """The generation a request goes to now, none of ``not_gens`` (of ``replica`` when
        given); None if none serves."""

    @property
    def quarantine(self) -> Quarantine:
        """Inputs that crashed two engines (``supervisor.suspects``): refused at admission."""

    def serving(self) -> bool: ...

    def probe_passed(self, replica: int) -> bool:
        """Whether ``replica``'s last probe passed (``health.probe`` keeps the counts)."""

    def count_outcome(self, outcome: str) -> None: ...

    def engine_died(self, gen: Generation, detail: str) -> None:
        """A request saw ``gen``'s engine die (the owner recovers it)."""

    def crashed_engines(self, event: Quarantined) -> None:
        """A request crashed two engines (the owner quarantines its input)."""


def ready(d: Dispatcher, app_current: bool = True) -> bool:
    """What ``/readyz`` and load balancers see: READY, the HTTP front has vLLM's app built on
    the current model config (``app_current``), and a serving replica's last probe passed."""
    return (d.state is State.READY and app_current
            and any(r.serving() and d.probe_passed(r.index) for r in d.replicas))
