"""Several Ray nodes on one machine (``ray.cluster_utils.Cluster``): TP=2 spread over two nodes,
one node removed mid-stream. With a spare node the daemon recovers on the remaining capacity
and the streams continue; without one it waits (``/readyz`` 503 with the reason) and resumes
once a node is added."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, as_operator
from chaos.load import PROMPTS, as_reference, compare, run_with_fault

pytestmark = [pytest.mark.integration, pytest.mark.extended]

MAX_TOKENS = 300


def node_pids(c) -> list[int]:
    """The processes of every node of a ``ray.cluster_utils`` cluster (the operator's)."""
    return [info.process.pid for node in c.list_all_nodes() for infos in node.all_processes.values()
            for info in infos if info.process is not None]


@pytest.fixture(scope="module")
def cluster():
    as_operator()  # the test process starts this cluster: its operator
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        try:
            inject.disconnect()
        finally:
            try:
                c.shutdown()
            except AttributeError:  # a removed node has no processes left to stop
                pass


def status(d: Daemon) -> dict:
    return d.get("/readyz?verbose").json()


class BackgroundStreams:
    """``n`` streams in a thread. ``started`` is set once every stream has tokens; then the
    fault is the main thread's (Ray's Cluster helpers want it), and the streams' runner waits
    up to ``hold_s`` for ``release`` before it collects them (``result``: records, None)."""

    def __init__(self, d: Daemon, n: int, hold_s: float):
        self.started, self.release, self.result = threading.Event(), threading.Event(), None

        def fault() -> None:
            self.started.set()
            self.release.wait(hold_s)

        self.thread = threading.Thread(target=lambda: setattr(
            self, "result", asyncio.run(run_with_fault(d.base_url, n, MAX_TOKENS, fault))))
        self.thread.start()
        assert self.started.wait(120)


def test_node_loss_waits_for_capacity_then_resumes(tmp_path, cluster):
    c, nodes = cluster
    config = {
        "engine": {"tensor_parallel_size": 2, "max_model_len": 1024},
        "ray": {"address": c.address, "placement_strategy": "STRICT_SPREAD", "placement_timeout_s": 5},
        "supervisor": {"max_restarts": 50, "restart_backoff_initial_s": 0.5, "restart_backoff_max_s": 2,
                       "probe_interval_s": 1.0, "hang_timeout_s": 10},
    }
    d = Daemon(tmp_path, config, env=OPERATOR_ENV).start()
    try:
        d.wait_ready()
        workers = inject.workers(c.address)
        assert len({w["node_id"] for w in workers}) == 2, workers  # spread over two nodes
        ref_records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))
        ref = as_reference(ref_records)
        before = status(d)["generation"]
        victim = nodes[1]
        load = BackgroundStreams(d, 4, hold_s=300)  # held until capacity is back
        c.remove_node(victim)  # Ray's Cluster helpers want the main thread
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # no capacity: not ready, and it says why
            r = d.get("/readyz")
            if r.status_code == 503 and r.json()["state"] == "recovering":
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"never saw RECOVERING: {d.get('/readyz').json()}")
        deadline = time.monotonic() + 60
        while "waiting for capacity" not in d.get("/readyz").json()["reason"]:
            assert time.monotonic() < deadline, d.get("/readyz").json()
            time.sleep(0.5)
        waiting = d.get("/readyz")
        assert waiting.status_code == 503 and "CPU" in waiting.json()["reason"], waiting.json()
        c.add_node(num_cpus=1)
        load.release.set()
        load.thread.join(300)
        records, _ = load.result
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        s = status(d)
        assert s["state"] == "ready" and s["generation"] > before
        first = s["recoveries"][0]
        # Seen as the worker's death on a lost node (Ray's death cause), not found late by
        # the hang timeout.
        assert first["reason"] == "worker_death" and first["cause"] == "node_lost", first
        assert re.search(r'^vllm_supervisor_worker_deaths_total\{cause="node_lost",replica="0"\} [1-9]', d.get("/metrics").text, re.M)
        assert len({w["node_id"] for w in inject.workers(c.address)}) == 2
        code, _ = d.stop(signal.SIGTERM)
        assert code == 0, d.tail()
        d.assert_nothing_left(keep=lambda: node_pids(c))  # nodes added during the test are the cluster's
        assert inject.inspect(c.address) == {"placement_groups": [], "actors": []}
    finally:
        if d.proc.poll() is None:
            d.kill()


def test_replicas_on_two_nodes_one_node_lost_streams_move_to_the_other(tmp_path, cluster):
    """Two TP=1 replicas placed on different nodes; the node of replica 0 is removed
    mid-stream: its streams continue at once on replica 1 (the daemon never leaves READY),
    replica 0 waits for capacity and rebuilds once a node is added."""
    c, _ = cluster
    config = {
        "engine": {"tensor_parallel_size": 1, "max_model_len": 1024},
        "ray": {"address": c.address, "placement_timeout_s": 3},
        "supervisor": {"replicas": 2, "max_restarts": 50, "restart_backoff_initial_s": 0.5, "restart_backoff_max_s": 2,
                       "probe_interval_s": 1.0, "hang_timeout_s": 10},
    }
    d = Daemon(tmp_path, config, env=OPERATOR_ENV).start()
    try:
        d.wait_ready()
        d.wait_replicas_serving()
        workers = d.full_status()["workers"]
        node_of = {w["replica"]: w["node_id"] for w in workers}
        assert len(set(node_of.values())) == 2, workers  # one replica per node
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        before = {r["replica"]: r["generation"] for r in status(d)["replicas"]}
        victim = next(n for n in c.list_all_nodes() if n.node_id == node_of[0])
        load = BackgroundStreams(d, 8, hold_s=120)
        c.remove_node(victim)
        load.release.set()
        states = set()
        while load.thread.is_alive():  # replica 1 finishes every stream while replica 0 has no node
            states.add(status(d)["state"])
            time.sleep(0.3)
        records, _ = load.result
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        s = status(d)
        assert s["state"] == "ready" and states == {"ready"}, (states, s)
        assert s["replicas"][0]["state"] == "recovering" and s["replicas"][1]["generation"] == before[1], s
        c.add_node(num_cpus=1)
        d.wait_replicas_serving({0: before[0]})
        rec = next(r for r in status(d)["recoveries"] if r["replica"] == 0)
        assert rec["reason"] == "worker_death" and rec["cause"] == "node_lost", rec
        nodes = {w["replica"]: w["node_id"] for w in d.full_status()["workers"]}
        assert len(set(nodes.values())) == 2 and nodes[1] == node_of[1], nodes
        code, _ = d.stop(signal.SIGTERM)
        assert code == 0, d.tail()
        d.assert_nothing_left(keep=lambda: node_pids(c))  # nodes added during the test are the cluster's
        assert inject.inspect(c.address) == {"placement_groups": [], "actors": []}
    finally:
        if d.proc.poll() is None:
            d.kill()
