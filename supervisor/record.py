"""A recovery record: opened at a replica's failure, it collects evidence while the recovery
runs and classifies the failure's cause once, at close.

Two reports can name a failure better than the one that started the recovery:

* a worker-death report that lost the race to a request's ``EngineDeadError`` (the engine
  core fails as its worker dies): it names the dead rank and Ray's cause. It counts only if
  it was detected before the recovery's teardown began (the teardown kills workers itself);
* the Ray cluster's loss, seen up to ``SEEN_LATE_S`` after a worker's or the engine core's
  death: the head's processes died together (the executor reports its workers gone at once;
  the loss counts only after ``gcs_lost_after_s``). The cause is then the cluster's loss.
"""

from __future__ import annotations

import time
from typing import Any

from health.clusterwatch import SEEN_LATE_S
from health.metrics import death_cause
from supervisor.events import EngineFailed


class RecoveryRecord:
    def __init__(self, replica: int, from_generation: int, event: EngineFailed):
        self.replica, self.from_generation, self.first = replica, from_generation, event
        self.opened_monotonic = time.monotonic()
        self.phases: dict[str, float] = {}
        self.teardown_monotonic: float | None = None
        self.standby: dict[str, Any] | None = None  # what the new generation adopted
        self.worker_death: EngineFailed | None = None  # a report that named the failure better
        self.cluster_lost: str | None = None  # the cluster's loss explains it (its reason)

    @property
    def detected_monotonic(self) -> float:
        return self.first.detected_monotonic

    def add_worker_death(self, event: EngineFailed) -> bool:
        """Evidence from a worker-death report of this record's generation; False when it adds
        nothing (the failure is already named, or the report came after the teardown began)."""
        if (event.reason != "worker_death" or self.reason != "engine_dead"
                or event.detected_monotonic >= (self.teardown_monotonic or float("inf"))):
            return False
        self.worker_death = event
        return True

    def add_cluster_lost(self, detected_monotonic: float, reason: str) -> bool:
        """The Ray cluster was lost (first seen at ``detected_monotonic``): True when it explains
        this record's failure."""
        if self.reason not in ("worker_death", "engine_dead") or self.detected_monotonic < detected_monotonic - SEEN_LATE_S:
            return False
        self.cluster_lost = reason
        return True

    @property
    def reason(self) -> str:
        """The failure's cause from the evidence so far (what the restart is counted as)."""
        if self.cluster_lost is not None:
            return "ray_lost"
        return "worker_death" if self.worker_death is not None else self.first.reason

    def close(self, ok: bool, to_generation: int, total_s: float) -> dict[str, Any]:
        """The record as ``status()["recoveries"]`` shows it, its cause classified once."""
        reason, detail = self.reason, self.first.detail
        if self.cluster_lost is not None:
            detail = self.cluster_lost
        elif self.worker_death is not None:
            detail = self.worker_death.detail
        out: dict[str, Any] = {
            "reason": reason, "detail": detail[:300], "from_generation": self.from_generation, "replica": self.replica,
            "detected_monotonic": self.detected_monotonic, "phases_s": self.phases,
            # from the whole of Ray's death cause (the detail is cut short)
            "cause": death_cause(detail) if reason == "worker_death" else None,
        }
        if reason != self.first.reason:
            out["refined_from"] = "worker_death" if self.worker_death is not None and reason == "ray_lost" else self.first.reason
        if self.teardown_monotonic is not None:
            out["teardown_monotonic"] = self.teardown_monotonic
        if self.standby is not None:
            out["standby"] = self.standby
        out.update(ok=ok, total_s=total_s, to_generation=to_generation, ready_monotonic=time.monotonic())
        return out
