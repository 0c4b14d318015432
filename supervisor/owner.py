"""What the owner's parts (``recovery``, ``clusterloss``, ``operations``) see of the owner: its
wiring (the shared state and the other parts), never its event loop or its dispatch.
``supervisor.daemon.Supervisor`` is the one implementation; tests build it over fakes."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Coroutine, Protocol

if TYPE_CHECKING:  # only parts that never import this module (the owner's own parts are Any here)
    from config import Settings
    from config.settings import SupervisorSettings
    from health.metrics import SupervisorMetrics
    from health.notify import SystemdNotifier
    from supervisor.builder import EngineBuilder
    from supervisor.raylink import RayLink
    from supervisor.engine_client import SupervisedEngineClient
    from supervisor.replica import Replica
    from supervisor.standby import Standby
    from supervisor.states import State, StateMachine


class Owner(Protocol):
    settings: "Settings"
    cfg: "SupervisorSettings"
    machine: "StateMachine"
    replicas: list["Replica"]
    builder: "EngineBuilder"
    ray: "RayLink"
    standby: "Standby"
    client: "SupervisedEngineClient"
    metrics: "SupervisorMetrics"
    notifier: "SystemdNotifier"
    recovery: Any  # supervisor.recovery.Recovery
    cluster: Any  # supervisor.clusterloss.ClusterLoss
    changed: asyncio.Event  # pulsed when what serves changes
    exit_code: int

    @property
    def state(self) -> "State": ...

    @property
    def generation_number(self) -> int: ...

    def post(self, event: Any) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task: ...

    def count_restart(self, reason: str, rep: "Replica") -> None: ...

    def worker_death_seen(self, event: Any, rep: "Replica") -> None: ...

