"""The state machines the owner's dispatch drives: the daemon's lifecycle (``State``) and each
replica's (``ReplicaState``), each an enum with its transition table. No imports beyond stdlib.

Only ``StateMachine.transition`` changes a state, and an illegal transition raises. Only the
owner's dispatch (``supervisor.owner``) calls it (``tests/unit/test_owner_alone.py``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Mapping, TypeVar


class State(str, enum.Enum):
    STARTING = "starting"  # building the first engine
    READY = "ready"  # serving
    RECOVERING = "recovering"  # a failure was detected; building the next generation
    DRAINING = "draining"  # operator drain / reload: finishing in-flight, admitting none
    STOPPING = "stopping"  # SIGTERM: finishing in-flight, then tearing down
    STOPPED = "stopped"  # terminal: clean exit (0)
    FAILED = "failed"  # terminal: restart budget exhausted or first start impossible

    @property
    def terminal(self) -> bool:
        return self in (State.STOPPED, State.FAILED)


TRANSITIONS: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.READY, State.RECOVERING, State.STOPPING, State.FAILED}),
    State.READY: frozenset({State.RECOVERING, State.DRAINING, State.STOPPING, State.FAILED}),
    State.RECOVERING: frozenset({State.READY, State.RECOVERING, State.STOPPING, State.FAILED}),
    State.DRAINING: frozenset({State.READY, State.RECOVERING, State.STOPPING, State.FAILED}),
    State.STOPPING: frozenset({State.STOPPED, State.FAILED}),
    State.STOPPED: frozenset(),
    State.FAILED: frozenset(),
}


class ReplicaState(str, enum.Enum):
    """One replica: a slot that holds one engine generation at a time. Every state but
    SERVING, WAITING and the two at the ends has one task of slow work under way
    (``supervisor.recovery``), which posts its result to the owner."""

    NEW = "new"  # not started yet
    PLACING = "placing"  # backoff, the Ray cluster's return, its placement group
    BUILDING = "building"  # its next generation's engine is built
    SERVING = "serving"  # its generation serves
    TEARING_DOWN = "tearing_down"  # its generation failed (or is rebuilt, or unwanted): drain, tear down
    WAITING = "waiting"  # its restart budget is spent: it tries again when the budget has room
    STOPPED = "stopped"  # the daemon stopped it (terminal)

    @property
    def busy(self) -> bool:
        """A task of slow work is under way."""
        return self in (ReplicaState.PLACING, ReplicaState.BUILDING, ReplicaState.TEARING_DOWN)


R = ReplicaState
REPLICA_TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    R.NEW: frozenset({R.PLACING, R.STOPPED}),
    R.PLACING: frozenset({R.BUILDING, R.PLACING, R.WAITING, R.STOPPED}),  # PLACING, WAITING: placement failed
    R.BUILDING: frozenset({R.SERVING, R.PLACING, R.WAITING, R.TEARING_DOWN, R.STOPPED}),  # TEARING_DOWN: built, unwanted
    R.SERVING: frozenset({R.TEARING_DOWN, R.STOPPED}),
    R.TEARING_DOWN: frozenset({R.PLACING, R.WAITING, R.STOPPED}),
    R.WAITING: frozenset({R.PLACING, R.STOPPED}),
    R.STOPPED: frozenset(),
}
del R


class IllegalTransition(RuntimeError):
    pass


E = TypeVar("E", bound=enum.Enum)


@dataclass
class StateMachine(Generic[E]):
    """Holds the current state of one unit; ``on_transition(old, new, reason)`` runs after each
    change. The default is the daemon's lifecycle; ``replica_machine()`` makes a replica's."""

    state: E = State.STARTING  # type: ignore[assignment]
    table: Mapping[E, frozenset[E]] = field(default_factory=lambda: TRANSITIONS)  # type: ignore[arg-type]
    reason: str = "daemon started"
    since_monotonic: float = field(default_factory=time.monotonic)
    on_transition: list[Callable[[E, E, str], None]] = field(default_factory=list)

    def can(self, to: E) -> bool:
        return to in self.table[self.state]

    def transition(self, to: E, reason: str) -> None:
        if not self.can(to):
            raise IllegalTransition(f"{self.state.value} -> {to.value} is not allowed ({reason})")
        old, self.state = self.state, to
        self.since_monotonic = time.monotonic()
        self.reason = reason
        for hook in self.on_transition:
            hook(old, to, reason)


def replica_machine() -> StateMachine[ReplicaState]:
    return StateMachine(ReplicaState.NEW, REPLICA_TRANSITIONS, "not started")
