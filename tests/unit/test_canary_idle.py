"""A worker stops spinning on its step ring after the empty step that frees a canary-only step
(``executor.canary.CanaryIdle``), in both executors' worker classes; a step that serves clients
keeps vLLM's spin."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from executor.canary import CANARY_PREFIX, CanaryIdle


class Spin:
    def __init__(self) -> None:
        self.last_read = 100.0


class VllmWorker:
    """vLLM's ``WorkerProc._execute_worker_rpc`` as far as the mixin sees it."""

    def __init__(self) -> None:
        self.rpc_broadcast_mq = SimpleNamespace(_spin_condition=Spin())
        self.ran: list[str] = []

    def _execute_worker_rpc(self, rpc_request: tuple) -> None:
        self.ran.append(rpc_request[0])


class Worker(CanaryIdle, VllmWorker):
    pass


def step(*request_ids: str) -> tuple:
    return ("execute_model", (SimpleNamespace(num_scheduled_tokens={r: 1 for r in request_ids}),), {}, None)


def spin_of(w: Worker) -> float:
    return w.rpc_broadcast_mq._spin_condition.last_read


def test_the_empty_step_after_a_canary_ends_the_spin():
    w = Worker()
    w._execute_worker_rpc(step(f"{CANARY_PREFIX}1"))
    assert spin_of(w) == 100.0  # not while the canary's own reply is read
    w._execute_worker_rpc(step())
    assert spin_of(w) == 0.0 and w.ran == ["execute_model", "execute_model"]


@pytest.mark.parametrize("steps", [[("client-1",), ()], [(f"{CANARY_PREFIX}1", "client-1"), ()], [(), ()]])
def test_a_step_that_serves_clients_keeps_the_spin(steps):
    w = Worker()
    for ids in steps:
        w._execute_worker_rpc(step(*ids))
    assert spin_of(w) == 100.0


def test_other_calls_pass_through():
    w = Worker()
    w._execute_worker_rpc(step(f"{CANARY_PREFIX}1"))
    w._execute_worker_rpc(("get_kv_cache_spec", (), {}, None))
    assert w.ran == ["execute_model", "get_kv_cache_spec"] and spin_of(w) == 100.0


def test_both_executors_workers_carry_it():
    from vllm.v1.executor.multiproc_executor import WorkerProc

    from executor.mp import SupervisedWorkerProc
    from executor.ray_v2 import SupervisedRayWorkerProc

    assert issubclass(SupervisedWorkerProc, CanaryIdle) and issubclass(SupervisedRayWorkerProc, CanaryIdle)
    # the mp executor's class is set only while it starts its workers: Ray V2's stays vLLM's
    import vllm.v1.executor.multiproc_executor as mpe

    assert mpe.WorkerProc is WorkerProc


def test_the_mp_executor_starts_its_workers_with_its_class(monkeypatch):
    """While vLLM's ``_init_executor`` forks the workers, the module's ``WorkerProc`` is ours;
    afterwards it is vLLM's again. With a list of cores per replica, ``VLLM_CPU_OMP_THREADS_BIND``
    is the replica's entry meanwhile (``executor.cpu_binding.replica_slice``)."""
    import vllm.v1.executor.multiproc_executor as mpe

    from executor.mp import SupervisedMultiprocExecutor, SupervisedWorkerProc

    seen = []

    def init(self) -> None:  # vLLM's: makes WorkerProc.make_worker_process(...) per rank
        seen.append((mpe.WorkerProc, os.environ.get("VLLM_CPU_OMP_THREADS_BIND")))
        self.workers = []

    def executor(replica: int):
        ex = object.__new__(SupervisedMultiprocExecutor)
        ex.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=1), additional_config={
            "vllm_supervisor": {"replicas": 2, "replica": replica}})
        return ex

    original = mpe.WorkerProc
    monkeypatch.setattr(mpe.MultiprocExecutor, "_init_executor", init)
    monkeypatch.setattr(SupervisedMultiprocExecutor, "_wire", lambda self: None)
    monkeypatch.setattr("executor.resume.install", lambda: None)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    SupervisedMultiprocExecutor._init_executor(executor(0))
    assert seen == [(SupervisedWorkerProc, None)] and mpe.WorkerProc is original
    # a list of cores per replica: vLLM's executor reads this replica's entry, as a DP rank's
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    SupervisedMultiprocExecutor._init_executor(executor(1))
    assert seen[-1] == (SupervisedWorkerProc, "1") and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
