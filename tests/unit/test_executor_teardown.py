"""A planned teardown does not wait for vLLM's worker monitor to poll out.

vLLM's ``RayExecutorV2.shutdown`` joins its monitor thread before it kills the workers, and
the monitor sits in ``ray.wait(run_refs, timeout=5.0)``: without the change every stop and
every reload's rebuild waited up to 5 s there. ``SupervisedRayExecutor`` kills the workers
first, so their ``run()`` refs resolve and the monitor, which sees ``shutting_down``,
returns at once, without the failure callback a worker death would run."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import executor.ray_v2 as ray_v2
from executor.ray_v2 import SupervisedRayExecutor

POLL_S = 5.0  # vLLM's monitor poll


def executor_with_vllms_monitor(monkeypatch) -> tuple[SupervisedRayExecutor, dict, threading.Event]:
    """An executor (no engine, no Ray) running vLLM's own monitor loop (``start_worker_monitor``),
    with ``ray.wait`` waiting as Ray's does: until a worker's ref resolves (its actor killed)
    or the 5 s poll runs out."""
    seen: dict = {"killed": [], "woken_by": [], "callbacks": 0}
    resolved = threading.Event()

    def kill(actor, no_restart=True):
        seen["killed"].append(actor)
        resolved.set()

    def wait(refs, num_returns=1, timeout=None):
        woken = resolved.wait(timeout)
        seen["woken_by"].append("a worker's ref" if woken else "the poll's end")
        return (refs[:1], refs[1:]) if woken else ([], refs)

    monkeypatch.setattr(ray_v2.ray, "kill", kill)
    monkeypatch.setattr(ray_v2.ray, "wait", wait)
    monkeypatch.setattr(ray_v2.ray, "is_initialized", lambda: True)
    ex = SupervisedRayExecutor.__new__(SupervisedRayExecutor)
    ex.shutting_down = False
    ex.failure_callback = lambda: seen.__setitem__("callbacks", seen["callbacks"] + 1)
    ex.ray_worker_handles = [SimpleNamespace(actor=f"actor-{r}", rank=r, run_ref=f"run-{r}") for r in range(2)]
    ex.start_worker_monitor()
    return ex, seen, resolved


def test_the_workers_are_killed_before_vllms_monitor_is_joined(monkeypatch):
    ex, seen, _ = executor_with_vllms_monitor(monkeypatch)
    ex.shutting_down = True  # as vLLM's shutdown sets it before the join
    ex._join_monitor_thread()
    assert not ex._monitor_thread.is_alive()
    assert seen == {"killed": ["actor-0", "actor-1"], "woken_by": ["a worker's ref"], "callbacks": 0}
    assert not getattr(ex, "is_failed", False)


def test_the_monitors_own_shutdown_kills_nothing_before_its_join(monkeypatch):
    """A worker died: the monitor thread itself calls shutdown, which vLLM does not join; nor
    does it kill early (vLLM's shutdown kills the survivors after the dead are recorded)."""
    ex, seen, resolved = executor_with_vllms_monitor(monkeypatch)
    ex.shutting_down = True
    returned = []
    own = threading.Thread(target=lambda: returned.append(ex._join_monitor_thread()), name="RayWorkerMonitor")
    ex._monitor_thread, monitor = own, ex._monitor_thread
    own.start()
    own.join(POLL_S)
    assert returned == [None] and seen["killed"] == []
    resolved.set()  # vLLM's monitor, still in its poll, goes too
    monitor.join(POLL_S)
