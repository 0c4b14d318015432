"""Real hosts, real network faults (``chaos.netns``): three network namespaces on a switch, each
a Ray worker node with its own address, the Ray head and the daemon in this namespace. TP=2 is
split across two hosts (``STRICT_SPREAD``), the third is spare.

* **A partition, then a heal.** The host of rank 1 loses its link mid-stream: it is alive, its
  worker goes on running, no packet passes. The step clock finds the hang within
  ``hang_timeout_s``; the teardown kills both workers (the partitioned one's kill waits in
  Ray's GCS); the next generation waits for the host (Ray still counts it alive, so the
  placement group keeps its bundle there) and is built once the link is back. Every stream
  continues exactly, and the zombie generation is fenced: its actors are dead after the heal
  and not one token came from it (the texts equal a fault-free run's).
* **A slow link** (a token bucket on both directions of a rank's link) for a minute of
  streaming: no recovery, every text exact; throughput and inter-token latency against a clean
  link are printed (``docs/benchmarks.md``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time

import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, as_operator, free_port
from chaos.load import PROMPTS, as_reference, compare, run_with_fault
from chaos.netns import Hosts, available

pytestmark = [pytest.mark.integration, pytest.mark.extended]

MAX_TOKENS = 200
HANG_TIMEOUT_S = 10.0
SLOW_RATE = "512kbit"  # both directions of a rank's link


@pytest.fixture(scope="module")
def hosts():
    if why := available():
        pytest.fail(f"real hosts need root and iproute2 (CI installs it): {why}")
    as_operator()  # the test process starts the cluster: its operator
    h = Hosts(3).make()
    try:
        h.start_head(OPERATOR_ENV, free_port())
        for i in range(3):
            h.start_node(i)
        yield h
    finally:
        try:
            inject.disconnect()
        finally:
            h.close()
        assert h.leftovers() == []  # namespaces, the switch and its links: gone


def tp2_daemon(tmp_path, hosts: Hosts, **supervisor) -> Daemon:
    config = {
        "engine": {"tensor_parallel_size": 2, "max_model_len": 1024},
        "ray": {"address": hosts.head_address, "placement_strategy": "STRICT_SPREAD", "placement_timeout_s": 10},
        "supervisor": {"max_restarts": 50, "restart_backoff_initial_s": 0.5, "restart_backoff_max_s": 2,
                       "probe_interval_s": 1.0, "hang_timeout_s": HANG_TIMEOUT_S, **supervisor},
    }
    return Daemon(tmp_path, config, env=OPERATOR_ENV).start()


def host_of_rank(d: Daemon, hosts: Hosts, rank: int) -> int:
    import ray

    inject.prepare(hosts.head_address)
    ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    worker = next(w for w in d.full_status()["workers"] if w["rank"] == rank)
    return next(h.index for h in hosts.hosts if h.address == ip[worker["node_id"]])


def stop_and_check(d: Daemon, hosts: Hosts) -> None:
    code, _ = d.stop(signal.SIGTERM)
    assert code == 0, d.tail()
    d.assert_nothing_left(keep=lambda: [p for i in range(len(hosts.hosts)) for p in hosts.pids(i)])
    assert inject.inspect(hosts.head_address) == {"placement_groups": [], "actors": []}


def test_partition_of_a_rank_host_then_heal_fences_the_zombie_generation(tmp_path, hosts):
    d = tp2_daemon(tmp_path, hosts)
    try:
        d.wait_ready(400)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        victim = host_of_rank(d, hosts, 1)
        zombie = [w for w in inject.workers(hosts.head_address) if "-g1" in w["name"]]
        assert len(zombie) == 2, zombie
        seen = {}

        def partition_then_heal() -> None:
            seen["partitioned"] = time.monotonic()
            hosts.partition(victim)
            while d.get("/readyz").json()["state"] != "recovering":  # the step clock finds it
                assert time.monotonic() - seen["partitioned"] < HANG_TIMEOUT_S + 15, d.get("/readyz").json()
                time.sleep(0.2)
            seen["detected"] = time.monotonic()
            time.sleep(20)  # partitioned for a while after the recovery began
            assert d.get("/readyz").status_code == 503  # its rank's bundle is on the host Ray still counts alive
            seen["healed"] = time.monotonic()
            hosts.heal(victim)

        records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS, partition_then_heal))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        detect_s = seen["detected"] - seen["partitioned"]
        assert detect_s <= HANG_TIMEOUT_S + 5, detect_s
        s = d.status()
        rec = next(r for r in s["recoveries"] if r["from_generation"] == 1)
        assert rec["reason"] == "hang" and rec["ok"], rec
        # the largest gap any stream saw after the partition: detection, teardown, the wait and the build
        gap = max(b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:]) if b > seen["partitioned"])
        print(json.dumps({"detect_s": round(detect_s, 1), "largest_gap_s": round(gap, 1),
                          "ready_after_heal_s": round(rec["ready_monotonic"] - seen["healed"], 1),
                          "phases_s": {k: round(v, 2) for k, v in rec["phases_s"].items()}}))
        # fenced: the zombie generation's actors are dead once the host is back, and none of
        # its processes runs on the healed host
        deadline = time.monotonic() + 60
        while alive := [w for w in inject.workers(hosts.head_address) if "-g1" in w["name"]]:
            assert time.monotonic() < deadline, f"the zombie generation's actors still alive after the heal: {alive}"
            time.sleep(1)
        assert not {w["pid"] for w in zombie} & set(hosts.pids(victim))
        stop_and_check(d, hosts)
    finally:
        if d.proc.poll() is None:
            d.kill()


def test_a_slow_link_causes_no_recovery(tmp_path, hosts):
    d = tp2_daemon(tmp_path, hosts)
    try:
        d.wait_ready(400)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        clean = [asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0] for _ in range(3)]  # warm
        victim = host_of_rank(d, hosts, 1)
        generation = d.status()["generation"]
        hosts.slow(victim, rate=SLOW_RATE, burst="16kbit", latency="500ms")
        try:
            started = time.monotonic()
            rounds = []
            while time.monotonic() - started < 60:  # a minute of streaming over the slow link
                records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))
                summary = compare(records, ref)
                assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
                rounds.append(records)
        finally:
            hosts.unslow(victim)
        s = d.status()
        assert s["generation"] == generation and not s["restarts"], s  # zero recoveries

        def figures(recs):
            gaps = [b - a for r in recs for a, b in zip(r.chunk_times, r.chunk_times[1:])]
            span = max(r.chunk_times[-1] for r in recs) - min(r.started for r in recs)
            return {"tokens_per_s": round(sum(len(r.chunk_times) for r in recs) / span, 1),
                    "itl_p50_ms": round(statistics.median(gaps) * 1000, 1)}

        clean_f, slow_f = [figures(r) for r in clean], [figures(r) for r in rounds]
        median = {k: statistics.median(f[k] for f in slow_f) for k in ("tokens_per_s", "itl_p50_ms")}
        print(json.dumps({"clean": clean_f, f"slow_{SLOW_RATE}": slow_f, "slow_median": median,
                          "throughput_ratio": round(median["tokens_per_s"] / statistics.median(f["tokens_per_s"] for f in clean_f), 3),
                          "itl_ratio": round(median["itl_p50_ms"] / statistics.median(f["itl_p50_ms"] for f in clean_f), 3)}))
        stop_and_check(d, hosts)
    finally:
        if d.proc.poll() is None:
            d.kill()


def test_partition_with_replicas_moves_streams_to_the_other_host(tmp_path, hosts):
    """Two TP=1 replicas on different hosts; replica 0's host is partitioned mid-stream: its
    streams move to replica 1 within seconds (the daemon stays READY), and replica 0 is built
    again on its host once the link is back."""
    config = {
        "engine": {"tensor_parallel_size": 1, "max_model_len": 1024},
        "ray": {"address": hosts.head_address, "placement_timeout_s": 10},
        "supervisor": {"replicas": 2, "max_restarts": 50, "restart_backoff_initial_s": 0.5, "restart_backoff_max_s": 2,
                       "probe_interval_s": 1.0, "hang_timeout_s": 3.0},
    }
    d = Daemon(tmp_path, config, env=OPERATOR_ENV).start()
    try:
        d.wait_ready(400)
        d.wait_replicas_serving()
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        import ray

        inject.prepare(hosts.head_address)
        ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        host_of = {w["replica"]: next(h.index for h in hosts.hosts if h.address == ip[w["node_id"]])
                   for w in d.full_status()["workers"]}
        assert host_of[0] != host_of[1], host_of
        before = {r["replica"]: r["generation"] for r in d.status()["replicas"]}
        seen = {}

        def partition() -> None:
            seen["partitioned"] = time.monotonic()
            hosts.partition(host_of[0])

        records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS, partition))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        # the largest gap any stream saw after the partition
        gap = max((b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:]) if b > seen["partitioned"]),
                  default=0.0)
        s = d.status()
        assert s["state"] == "ready" and s["replicas"][1]["generation"] == before[1], s
        assert gap < 5.0, gap
        hosts.heal(host_of[0])
        d.wait_replicas_serving({0: before[0]})
        rec = next(r for r in d.status()["recoveries"] if r["replica"] == 0)
        print(json.dumps({"largest_gap_s": round(gap, 2), "reason": rec["reason"],
                          "phases_s": {k: round(v, 2) for k, v in rec["phases_s"].items()}}))
        assert rec["reason"] == "hang" and rec["ok"], rec
        deadline = time.monotonic() + 60
        while alive := [w for w in inject.workers(hosts.head_address) if f"-g{before[0]}" in w["name"]]:
            assert time.monotonic() < deadline, f"the zombie generation's actors still alive after the heal: {alive}"
            time.sleep(1)
        stop_and_check(d, hosts)
    finally:
        if d.proc.poll() is None:
            d.kill()
