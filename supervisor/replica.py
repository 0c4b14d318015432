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

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from config.settings import SupervisorSettings
from supervisor.generation import Generation
from supervisor.policy import RestartIntensity


@dataclass(eq=False)
class Replica:
    index: int
    current: Generation | None = None  # the generation it serves, or the failed one until torn down
    building: int | None = None  # the generation number being built
    recovery: asyncio.Task | None = None  # its start or recovery, while one runs
    record: Any = None  # the recovery under way (``supervisor.record``)
    served: bool = False  # a generation of it has been up
    probe_failures: int = 0  # consecutive (``health.probe``)
    retry_at: float | None = None  # monotonic: its budget is spent; it tries again then
    last_error: str = ""  # why its last build failed (cleared when it serves)
    # the owner builds it from its settings; the default (the settings' defaults) is for a Replica built alone
    intensity: RestartIntensity = field(default_factory=lambda: RestartIntensity(
        SupervisorSettings.model_fields["max_restarts"].default, SupervisorSettings.model_fields["restart_window_s"].default))

    def serving(self, not_gen: Generation | None = None) -> bool:
        gen = self.current
        return gen is not None and not gen.failed and gen is not not_gen

    @property
    def busy(self) -> bool:
        return self.recovery is not None and not self.recovery.done()

    @property
    def state(self) -> str:
        """serving | starting | recovering | waiting | down (for status and the ``replica_up`` metric)."""
        if self.serving():
            return "serving"
        if self.retry_at is not None:
            return "waiting"
        if self.busy or self.building is not None:
            return "recovering" if self.served else "starting"
        return "down"

    def status(self) -> dict[str, Any]:
        gen = self.current
        return {"replica": self.index, "state": self.state, "generation": gen.number if gen else 0,
                "instance_id": gen.instance_id if gen else "", "streams": len(gen.pumps) if gen else 0,
                "building": self.building, "probe_failures": self.probe_failures,
                "restarts_in_window": self.intensity.recent,
                **({"retry_in_s": round(max(0.0, self.retry_at - time.monotonic()), 1)} if self.retry_at else {}),
                **({"last_error": self.last_error} if self.last_error else {})}


def pick(replicas: Iterable[Replica], not_gen: Generation | None = None, epoch: int | None = None,
         router: Any = None, token_ids: Sequence[int] | None = None, replica: int | None = None) -> Generation | None:
    """The serving generation a request goes to, other than ``not_gen``, built for config
    ``epoch`` and of ``replica`` (when given); None when none serves. With a ``router``
    (``supervisor.routing``) and the prompt's ``token_ids``, where its prefix was served; else
    the one with the fewest streams running (ties: the lowest index)."""
    candidates = [rep.current for rep in replicas
                  if rep.serving(not_gen) and (epoch is None or rep.current.epoch == epoch)
                  and (replica is None or rep.index == replica)]
    if not candidates:
        return None
    if router is not None and token_ids and len(candidates) > 1:
        return router.choose(candidates, token_ids, load=_streams)
    return min(candidates, key=_streams)


def _streams(gen: Generation) -> int:
    return len(gen.pumps)


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
