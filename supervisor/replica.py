"""Engine replicas and the router between them.

A daemon runs ``supervisor.replicas`` replicas (``--replicas N``, default 1). A replica is a
slot that holds one engine generation at a time and recovers on its own: its own placement
group (``EngineBuilder.ensure_placement_group(index)``), its own worker actors, its own
recovery task, its own restart budget (``max_restarts`` in ``restart_window_s``).
Generation numbers are global across replicas, so a worker-death report (which names its
generation) names its replica too.

The daemon is READY while at least one replica serves. A replica whose budget is spent
while another serves (or is on its way up) waits until the budget allows one more restart,
then tries again ("waiting"); the daemon fails (exit 3) only when no replica serves or can.

``pick`` routes a new request to the replica that served its prompt's prefix
(``supervisor.routing``, ``routing = "prefix"``, the default) unless that one is loaded past
a bound, else to the serving replica with the fewest streams running (least outstanding
requests); when a replica fails, its streams are parked and ``pick`` gives them another
serving replica at once (live migration: ``supervisor.stream`` continues them with
prompt + delivered tokens, exactly as after a single-engine recovery).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from config.settings import SupervisorSettings
from supervisor.generation import Generation
from supervisor.policy import RestartIntensity
from supervisor.states import ReplicaState, StateMachine, replica_machine


@dataclass(eq=False)
class Replica:
    """One replica as the owner holds it. Only the owner's dispatch (``supervisor.owner``)
    changes it; readers see ``ReplicaView`` in the owner's snapshot."""

    index: int
    machine: StateMachine[ReplicaState] = field(default_factory=replica_machine)
    current: Generation | None = None  # the generation it serves, or the failed one until torn down
    building: int | None = None  # the generation number being built
    record: Any = None  # the recovery under way (``supervisor.record``)
    served: bool = False  # a generation of it has been up
    first: bool = True  # its first start: the first build is not counted against the budget
    attempt: int = 0  # builds tried since it last served or failed (the backoff's exponent)
    retry_at: float | None = None  # monotonic, while WAITING: it tries again then
    last_error: str = ""  # why its last build failed (cleared when it serves)
    # the owner builds it from its settings; the default (the settings' defaults) is for a Replica built alone
    intensity: RestartIntensity = field(default_factory=lambda: RestartIntensity(
        SupervisorSettings.model_fields["max_restarts"].default, SupervisorSettings.model_fields["restart_window_s"].default))

    @property
    def state(self) -> ReplicaState:
        return self.machine.state

    def serving(self, not_gens: tuple[Generation, ...] = ()) -> bool:
        gen = self.current
        return (self.state is ReplicaState.SERVING and gen is not None and not gen.failed
                and all(gen is not g for g in not_gens))

    @property
    def busy(self) -> bool:
        """Slow work under way, or waiting for its budget (what a reload waits for)."""
        return self.state.busy or self.state is ReplicaState.WAITING

    def view(self) -> "ReplicaView":
        return ReplicaView(self.index, self.state, self.current, self.served)

    def status(self, probe_failures: int = 0) -> dict[str, Any]:
        gen = self.current
        return {"replica": self.index, "state": self.view().word, "phase": self.state.value,
                "generation": gen.number if gen else 0,
                "instance_id": gen.instance_id if gen else "", "streams": len(gen.readers) if gen else 0,
                "building": self.building, "probe_failures": probe_failures,
                "restarts_in_window": self.intensity.recent,
                **({"retry_in_s": round(max(0.0, self.retry_at - time.monotonic()), 1)} if self.retry_at else {}),
                **({"last_error": self.last_error} if self.last_error else {})}


@dataclass(frozen=True, eq=False)
class ReplicaView:
    """A replica as readers see it (``supervisor.snapshot``): immutable, taken by the owner."""

    index: int
    state: ReplicaState
    current: Generation | None
    served: bool

    def serving(self, not_gens: tuple[Generation, ...] = ()) -> bool:
        gen = self.current
        return (self.state is ReplicaState.SERVING and gen is not None and not gen.failed
                and all(gen is not g for g in not_gens))

    @property
    def word(self) -> str:
        """serving | starting | recovering | waiting | down (status and the ``replica_up`` metric)."""
        if self.state is ReplicaState.SERVING:
            return "serving"
        if self.state is ReplicaState.WAITING:
            return "waiting"
        if self.state.busy:
            return "recovering" if self.served else "starting"
        return "down"

    def key(self) -> tuple:
        return (self.index, self.state, id(self.current), self.current.failed if self.current else None)


def pick(replicas: Iterable[Replica], not_gens: tuple[Generation, ...] = (), epoch: int | None = None,
         router: Any = None, token_ids: Sequence[int] | None = None, replica: int | None = None) -> Generation | None:
    """The serving generation a request goes to, none of ``not_gens``, built for config
    ``epoch`` and of ``replica`` (when given); None when none serves. With a ``router``
    (``supervisor.routing``) and the prompt's ``token_ids``, where its prefix was served; else
    the one with the fewest streams running (ties: the lowest index)."""
    candidates = [rep.current for rep in replicas
                  if rep.serving(not_gens) and (epoch is None or rep.current.epoch == epoch)
                  and (replica is None or rep.index == replica)]
    if not candidates:
        return None
    if router is not None and token_ids and len(candidates) > 1:
        return router.choose(candidates, token_ids, load=_streams)
    return min(candidates, key=_streams)


def _streams(gen: Generation) -> int:
    return len(gen.readers)


def replica_of(replicas: Iterable[Replica], generation: int) -> Replica | None:
    """The replica whose current generation is ``generation``."""
    for rep in replicas:
        if rep.current is not None and rep.current.number == generation:
            return rep
    return None


def building(replicas: Iterable[Replica], generation: int) -> Replica | None:
    """The replica building ``generation``."""
    for rep in replicas:
        if rep.building == generation:
            return rep
    return None
