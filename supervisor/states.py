"""The daemon's lifecycle: one state enum and its transition table. No imports beyond stdlib.

Only ``StateMachine.transition`` changes the state; an illegal transition raises.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable


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


class IllegalTransition(RuntimeError):
    pass


@dataclass
class StateMachine:
    """Holds the current state; ``on_transition(old, new, reason)`` runs after each change."""

    state: State = State.STARTING
    since_monotonic: float = field(default_factory=time.monotonic)
    reason: str = "daemon started"
    on_transition: list[Callable[[State, State, str], None]] = field(default_factory=list)

    def can(self, to: State) -> bool:
        return to in TRANSITIONS[self.state]

    def transition(self, to: State, reason: str) -> None:
        if not self.can(to):
            raise IllegalTransition(f"{self.state.value} -> {to.value} is not allowed ({reason})")
        old, self.state = self.state, to
        self.since_monotonic = time.monotonic()
        self.reason = reason
        for hook in self.on_transition:
            hook(old, to, reason)
