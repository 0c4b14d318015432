"""The Ray agent imports the standby worker's class ahead, on a thread of its own, and touches
vLLM elsewhere only once that import is done (``executor.rayagent``): vLLM resolves its platform
object without a lock, so two threads importing it at once could each build one."""

from __future__ import annotations

import pickle
import threading

import pytest

import executor.standby as standby
from executor.rayagent import RayService, WorkerClassImport

UNPICKLED: list[bool] = []  # for each unpickling of a Config: was the import done by then?
IMPORT_DONE = threading.Event()


def _unpickle() -> str:
    UNPICKLED.append(IMPORT_DONE.is_set())
    return "the config"


class Config:
    """Stands for a ``VllmConfig``: its unpickling is what would import vLLM."""

    def __reduce__(self):
        return (_unpickle, ())


def service_with(class_import: WorkerClassImport) -> RayService:
    service = object.__new__(RayService)  # no Ray: only the standby's calls are used
    service.handles = {}
    service.class_import = class_import
    return service


def slow_import(monkeypatch, until: threading.Event) -> WorkerClassImport:
    imp = WorkerClassImport()
    monkeypatch.setattr(imp, "_run", lambda: until.wait(30))
    return imp


def started_with_a_join_signal(imp: WorkerClassImport) -> threading.Event:
    """Start ``imp``; the event is set when a call begins to wait for it (no timing involved:
    a call that does not wait never sets it)."""
    imp.start()
    joined, join = threading.Event(), imp._thread.join

    def signalling_join(timeout=None):
        joined.set()
        return join(timeout)

    imp._thread.join = signalling_join
    return joined


def test_create_standby_unpickles_its_config_only_after_the_worker_class_import(monkeypatch):
    UNPICKLED.clear()
    IMPORT_DONE.clear()
    made: list = []
    monkeypatch.setattr(standby, "create_standby_workers",
                        lambda cfg, *args: [{"actor_id": "a1", "name": "w", "handle": object(), "config": cfg}])
    imp = slow_import(monkeypatch, IMPORT_DONE)
    joined = started_with_a_join_signal(imp)
    service = service_with(imp)
    call = threading.Thread(target=lambda: made.extend(
        service.create_standby(pickle.dumps(Config()), None, "inst-g1", "ns", {})))
    call.start()
    assert joined.wait(10), "create_standby did not wait for the import"
    assert UNPICKLED == [] and not made, "the config was unpickled while the import ran"
    IMPORT_DONE.set()
    call.join(10)
    assert UNPICKLED == [True]
    assert made == [{"actor_id": "a1", "name": "w", "config": "the config"}]
    assert service.handles["a1"][0] == "w"
    assert imp.report()["asked"] and "first_wait_s" in imp.report()


def test_the_other_standby_calls_wait_for_the_import_too(monkeypatch):
    done = threading.Event()
    asked: list = []
    monkeypatch.setattr(standby, "actor_state", lambda a: asked.append(done.is_set()) or {"state": "DEAD"})
    imp = slow_import(monkeypatch, done)
    joined = started_with_a_join_signal(imp)
    call = threading.Thread(target=lambda: service_with(imp).standby_states(["a1"]))
    call.start()
    assert joined.wait(10), "standby_states did not wait for the import"
    assert asked == []
    done.set()
    call.join(10)
    assert asked == [True]


def test_no_import_asked_waits_for_nothing_and_a_hung_one_is_bounded(monkeypatch):
    assert WorkerClassImport().report() == {"asked": False}
    WorkerClassImport().wait()  # returns at once
    never = threading.Event()
    imp = slow_import(monkeypatch, never)
    monkeypatch.setattr(WorkerClassImport, "WAIT_S", 0.2)
    imp.start()
    with pytest.raises(TimeoutError, match="not done after"):
        imp.wait()
    never.set()


def test_the_real_import_reports_its_outcome():
    imp = WorkerClassImport()
    imp.start()
    imp.wait()
    report = imp.report()
    assert report["asked"] and report["done"] and report["ok"], report
    assert report["took_s"] >= 0 and report["first_wait_s"] >= 0
