"""What every reader of the daemon sees: one immutable snapshot, published by the owner's
dispatch (``supervisor.owner``) after each event that changed something. The request path,
``/readyz``, the detectors, the status and the CLI read it; none of them reads the owner."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.replica import ReplicaView
from supervisor.states import State


@dataclass(frozen=True, eq=False)
class Snapshot:
    state: State
    reason: str  # why the daemon is in ``state`` (said in every 503)
    generation: int  # the newest generation a replica holds (0: none)
    epoch: int  # the engine arguments the owner wants served (a reload adds one)
    replicas: tuple[ReplicaView, ...]

    def key(self) -> tuple:
        return (self.state, self.reason, self.generation, self.epoch, tuple(r.key() for r in self.replicas))
