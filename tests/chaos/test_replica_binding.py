"""``VLLM_CPU_OMP_THREADS_BIND=0|1`` with ``--data-parallel-size 2`` on vLLM's ``mp`` executor (the
extended tier). On Ray V2, the default, the binding and the standby that follows the replica it
serves are checked on the replicas module's daemon, which runs with the same list
(``tests/chaos/test_replicas.py::test_a_list_per_replica_binds_each_replica_and_the_standby_follows_the_one_it_serves``:
a daemon start fewer in ``make test``)."""

from __future__ import annotations

import asyncio

import pytest

from chaos import inject
from chaos.harness import Daemon
from chaos.load import as_reference, compare, run_with_fault
from tests.chaos.test_replicas import cores

pytestmark = pytest.mark.integration

STREAMS, MAX_TOKENS = 8, 300


@pytest.mark.extended  # the same binding on vLLM's own executor; its slicing is unit-tested in the default tier
def test_mp_replicas_take_their_entries_as_vllms_ranks_do(tmp_path):
    """On vLLM's ``mp`` executor (no Ray, no standby workers) each replica's engine core hands vLLM
    its entry of the list (vLLM alone reads each replica as rank 0: every worker on core 0, as checked
    with the slicing taken out)."""
    config = {"engine": {"executor": "mp", "tensor_parallel_size": 1, "max_model_len": 1024},
              "supervisor": {"probe_interval_s": 1.0}}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # no Ray
    with Daemon(tmp_path, config, env=env, args=("--data-parallel-size", "2")).start() as d:
        d.wait_ready()
        d.wait_replicas_serving()
        workers = inject.child_pids(set(inject.engine_core_pids(d.proc.pid)), b"VLLM::Worker")
        assert sorted(cores(pid) for pid in workers) == [[0], [1]], workers  # one per replica's engine core
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, STREAMS, 64))[0])
        again = compare(asyncio.run(run_with_fault(d.base_url, STREAMS, 64))[0], ref)
        assert again["failed"] == 0 and again["mismatched"] == 0, again
        code, _ = d.stop()
        assert code == 0, d.tail()
        d.assert_nothing_left()
