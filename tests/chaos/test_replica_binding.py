"""``VLLM_CPU_OMP_THREADS_BIND=0|1`` with ``--data-parallel-size 2``, as an operator exports it for
``vllm serve`` on a CPU host: each replica's worker runs on its own core, as vLLM binds each
data-parallel rank (before, vLLM read each replica as rank 0 and bound every worker to core 0). The one
warm standby is made with one replica's core; ``ray.kill`` of the *other* replica's worker under
streams: the standby is adopted anyway, bound again to the killed replica's core, and what the
clients read equals the fault-free run. Real Ray head, real vLLM-cpu engines, the openai SDK."""

from __future__ import annotations

import asyncio
import os

import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon
from chaos.load import as_reference, compare, run_with_fault
from tests.chaos.test_recovery import FAST_PROBES, stop_leaves_nothing
from tests.chaos.test_replicas import kill_replica, workers_by_replica

pytestmark = pytest.mark.integration

STREAMS, MAX_TOKENS = 8, 300


def cores(pid: int) -> list[int]:
    """The cores ``pid``'s main thread may run on."""
    return sorted(os.sched_getaffinity(pid))


def test_a_list_per_replica_binds_each_replica_and_the_standby_follows_the_one_it_serves(tmp_path, ray_head):
    config = {"engine": {"tensor_parallel_size": 1, "max_model_len": 1024}, "ray": {"address": ray_head.address},
              "supervisor": {**FAST_PROBES, "max_restarts": 5}}
    env = {**OPERATOR_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with Daemon(tmp_path, config, env=env, args=("--data-parallel-size", "2")).start() as d:
        d.wait_ready()
        before = {r["replica"]: r["generation"] for r in d.wait_replicas_serving()}
        workers = workers_by_replica(d)
        assert [cores(workers[i]["pid"]) for i in (0, 1)] == [[0], [1]], workers
        standby_pid = d.wait_standby("ready")["standby"]["workers"][0]["pid"]
        made_for = cores(standby_pid)
        assert made_for in ([0], [1]), made_for
        index = 1 - made_for[0]  # the replica whose core the standby was not made with
        inject.prepare(ray_head.address)  # the fault injector's Ray connection, made before the streams
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, STREAMS, MAX_TOKENS))[0])
        records, info = asyncio.run(run_with_fault(d.base_url, STREAMS, MAX_TOKENS,
                                                   lambda: kill_replica(d, ray_head, index)))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, info)
        assert all(r.usage_completion_tokens == MAX_TOKENS and r.finish_reason == "length" for r in records)
        d.wait_replicas_serving({index: before[index]})
        rec = d.status()["recoveries"][-1]
        assert rec["replica"] == index and rec["ok"] and rec["standby"] == {"result": "adopted", "adopted_ranks": [0]}, rec
        after = workers_by_replica(d)
        assert after[index]["pid"] == standby_pid, (standby_pid, after)
        assert cores(standby_pid) == [index] and cores(after[1 - index]["pid"]) == [1 - index]
        again = compare(asyncio.run(run_with_fault(d.base_url, STREAMS, MAX_TOKENS))[0], ref)
        assert again["failed"] == 0 and again["mismatched"] == 0, again
        print(f"\nreplica {index} killed, the standby made with core {made_for[0]} adopted on core {index}: "
              f"{STREAMS} streams exact; rebuilt in {rec['total_s']:.1f} s")
        stop_leaves_nothing(d, ray_head)


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
