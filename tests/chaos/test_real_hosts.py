"""Real hosts, real network faults (``chaos.netns``): three network namespaces on a switch, each
a Ray worker node with its own address, the Ray head and the daemon in this namespace. TP=2 is
split across two hosts (``STRICT_SPREAD``), the third is spare.

* **A partition, then a heal**, from either side: the host of rank 1 loses its link
  (worker side), or this namespace loses its route to it (head side), mid-stream. The host is
  alive, its worker goes on running, no packet is answered. The step clock finds the hang
  within ``hang_timeout_s``; the teardown kills both workers (the partitioned one's kill waits
  in Ray's GCS); the next generation is built **on the capacity that is left while the host is
  still cut off** (its placement group avoids the node this host cannot reach, which Ray still
  counts alive). Every stream continues exactly, and after the heal the zombie generation is
  fenced: its actors are dead, none of its processes runs on the host, and not one token came
  from it (the texts equal a fault-free run's). The host's capacity counts again.
* **A node killed** (every process of rank 1's host, SIGKILL: a power cut), the same load: the
  figures to set beside a partition's (Ray sees this at once; a partition only the step clock).
* **A slow link** (a token bucket on both directions of a rank's link) for a minute of
  streaming: no recovery, every text exact; throughput and inter-token latency against a clean
  link are printed (``docs/benchmarks.md``).
* **Replicas on two hosts**: the partitioned one's streams move to the other within seconds.
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
SETTLE_AFTER_HEAL_S = 25.0  # Ray's health-check timeout (10 s) after the heal, with margin


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


def revive(hosts: Hosts, only: set[int] | None = None) -> None:
    """Every host's Ray node alive (or those in ``only``): one Ray marked dead (its raylet
    exits when it hears so after a heal) is started again, as the node's supervisor (systemd,
    KubeRay) does."""
    import ray

    for h in hosts.hosts:  # a test that failed half-way may have left one cut off
        if h.partitioned and (only is None or h.index in only):
            hosts.heal(h.index)
    inject.prepare(hosts.head_address)
    wanted = [h for h in hosts.hosts if only is None or h.index in only]
    # Ray's health checks that were in flight at a heal may still fail it (a 10 s timeout each)
    # and mark the host dead after it looked alive here: wait them out before trusting "alive".
    if only is None and (settle := max((h.healed_monotonic + SETTLE_AFTER_HEAL_S for h in wanted), default=0)
                         - time.monotonic()) > 0:
        time.sleep(settle)
    for h in wanted:
        alive = any(n["Alive"] and n["NodeManagerAddress"] == h.address for n in ray.nodes())
        if not alive:
            hosts.kill_node(h.index)
            hosts.start_node(h.index)
    deadline = time.monotonic() + 60
    while not all(any(n["Alive"] and n["NodeManagerAddress"] == h.address for n in ray.nodes()) for h in wanted):
        assert time.monotonic() < deadline, ray.nodes()
        time.sleep(0.5)


def node_of(hosts: Hosts, address: str) -> str:
    """The Ray node id of the alive node at ``address``."""
    import ray

    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == address)


def largest_gap(records, after: float) -> float:
    """The largest gap between two chunks any stream saw, counting the gaps that ended after ``after``."""
    return max((b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:]) if b > after), default=0.0)


def wait_actors_gone(hosts: Hosts, mark: str, what: str, timeout_s: float = 60) -> None:
    """Wait until no live worker actor's name contains ``mark`` (a generation's instance suffix)."""
    deadline = time.monotonic() + timeout_s
    while alive := [w for w in inject.workers(hosts.head_address) if mark in w["name"]]:
        assert time.monotonic() < deadline, f"{what} still alive after the heal: {alive}"
        time.sleep(1)


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


@pytest.mark.parametrize("side", ["host", "head"], ids=["worker-side", "head-side"])
def test_partition_of_a_rank_host_recovers_on_what_is_left_and_the_heal_fences_the_zombie(tmp_path, hosts, side):
    revive(hosts)
    d = tp2_daemon(tmp_path, hosts)
    try:
        d.wait_ready(400)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        victim = host_of_rank(d, hosts, 1)
        victim_node = node_of(hosts, hosts.hosts[victim].address)
        zombie = [w for w in inject.workers(hosts.head_address) if "-g1" in w["name"]]
        assert len(zombie) == 2, zombie
        seen = {}

        def partition() -> None:
            seen["partitioned"] = time.monotonic()
            hosts.partition(victim, side=side)
            while d.get("/readyz").json()["state"] != "recovering":  # the step clock finds it
                assert time.monotonic() - seen["partitioned"] < HANG_TIMEOUT_S + 15, d.get("/readyz").json()
                time.sleep(0.2)
            seen["detected"] = time.monotonic()

        records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS, partition))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        # recovered on the two hosts left while the third is still cut off
        assert not hosts.reachable(victim, 1)  # still cut off (a healed host answers: refused)
        assert d.get("/readyz").status_code == 200, d.get("/readyz").json()
        new = [w for w in d.full_status()["workers"]]
        assert len(new) == 2 and victim_node not in {w["node_id"] for w in new}, new
        detect_s = seen["detected"] - seen["partitioned"]
        assert detect_s <= HANG_TIMEOUT_S + 5, detect_s
        rec = next(r for r in d.status()["recoveries"] if r["from_generation"] == 1)
        assert rec["reason"] == "hang" and rec["ok"], rec
        # the largest gap any stream saw after the partition: detection, teardown and the build
        gap = largest_gap(records, seen["partitioned"])
        print(json.dumps({"side": side, "detect_s": round(detect_s, 1), "largest_gap_s": round(gap, 1),
                          "ready_after_partition_s": round(rec["ready_monotonic"] - seen["partitioned"], 1),
                          "phases_s": {k: round(v, 2) for k, v in rec["phases_s"].items()}}))

        hosts.heal(victim)
        # fenced: the zombie generation's actors are dead once the host is back, and none of
        # its processes runs on the healed host
        deadline = time.monotonic() + 90
        wait_actors_gone(hosts, "-g1", "the zombie generation's actors", timeout_s=90)
        while set(w["pid"] for w in zombie) & set(hosts.pids(victim)):
            assert time.monotonic() < deadline, "a zombie worker still runs on the healed host"
            time.sleep(1)
        # nothing it sent was read: the new generation served on, no second recovery
        s = d.status()
        assert s["state"] == "ready" and len(s["recoveries"]) == 1, s["recoveries"]
        revive(hosts)  # its capacity counts again (restarted if Ray marked it dead meanwhile)
        stop_and_check(d, hosts)
    finally:
        if d.proc.poll() is None:
            d.kill()


def test_a_killed_rank_host_recovers_on_the_spare_host(tmp_path, hosts):
    """The same load and layout as the partition, the host killed instead (a power cut): the
    figures to set beside a partition's."""
    revive(hosts)
    d = tp2_daemon(tmp_path, hosts)
    try:
        d.wait_ready(400)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        victim = host_of_rank(d, hosts, 1)
        seen = {}

        def kill() -> None:
            seen["killed"] = time.monotonic()
            hosts.kill_node(victim)
            while d.get("/readyz").json()["state"] != "recovering":
                assert time.monotonic() - seen["killed"] < HANG_TIMEOUT_S + 15, d.get("/readyz").json()
                time.sleep(0.2)
            seen["detected"] = time.monotonic()

        records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS, kill))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        rec = next(r for r in d.status()["recoveries"] if r["from_generation"] == 1)
        assert rec["ok"], rec
        gap = largest_gap(records, seen["killed"])
        print(json.dumps({"fault": "node killed", "reason": rec["reason"],
                          "detect_s": round(seen["detected"] - seen["killed"], 1), "largest_gap_s": round(gap, 1),
                          "ready_after_kill_s": round(rec["ready_monotonic"] - seen["killed"], 1),
                          "phases_s": {k: round(v, 2) for k, v in rec["phases_s"].items()}}))
        revive(hosts)
        stop_and_check(d, hosts)
    finally:
        if d.proc.poll() is None:
            d.kill()


def test_a_slow_link_causes_no_recovery(tmp_path, hosts):
    revive(hosts)
    d = tp2_daemon(tmp_path, hosts)
    try:
        d.wait_ready(400)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        d.wait_standby()  # its preparation (vLLM imported in a worker per rank) would slow the clean rounds
        clean = [asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0] for _ in range(2)]  # warm, before
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
        # and after: the clean link's figures on both sides of the slow minute (the machine's
        # other load changes over a minute; the ratio must not take that for the link's)
        clean += [asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0] for _ in range(2)]
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
    streams move to replica 1 within seconds (the daemon stays READY), replica 0 is built again
    on the spare host while the link is down, and its zombie is fenced once the link is back."""
    revive(hosts)
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
        victim_node = node_of(hosts, hosts.hosts[host_of[0]].address)
        before = {r["replica"]: r["generation"] for r in d.status()["replicas"]}
        seen = {}

        def partition() -> None:
            seen["partitioned"] = time.monotonic()
            hosts.partition(host_of[0])

        records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS, partition))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        # the largest gap any stream saw after the partition
        gap = largest_gap(records, seen["partitioned"])
        s = d.status()
        assert s["state"] == "ready" and s["replicas"][1]["generation"] == before[1], s
        assert gap < 5.0, gap
        d.wait_replicas_serving({0: before[0]})  # rebuilt while its host is still cut off
        assert not hosts.reachable(host_of[0], 1)  # still cut off
        assert victim_node not in {w["node_id"] for w in d.full_status()["workers"] if w["replica"] == 0}
        hosts.heal(host_of[0])
        rec = next(r for r in d.status()["recoveries"] if r["replica"] == 0)
        print(json.dumps({"largest_gap_s": round(gap, 2), "reason": rec["reason"],
                          "phases_s": {k: round(v, 2) for k, v in rec["phases_s"].items()}}))
        assert rec["reason"] == "hang" and rec["ok"], rec
        wait_actors_gone(hosts, f"-g{before[0]}", "the zombie generation's actors")
        revive(hosts)
        stop_and_check(d, hosts)
    finally:
        if d.proc.poll() is None:
            d.kill()


def test_the_daemon_alone_fences_an_adopted_zombie_after_a_short_partition(tmp_path, hosts):
    """The zombie that only the daemon can fence: a generation whose workers were adopted from
    the warm standby (their Ray owner is the daemon's agent, which lives on, so Ray does not end
    them with the engine core), on a host partitioned for a few seconds (Ray never marks it dead).
    The daemon's kill of the generation's actors, queued while the link is down, lands at the
    heal: the zombie is gone, no token came from it, and the next generation serves."""
    revive(hosts)
    d = tp2_daemon(tmp_path, hosts, hang_timeout_s=3.0)
    try:
        d.wait_ready(400)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        d.wait_standby()
        inject.kill_worker(hosts.head_address, rank=0)  # generation 2 adopts the standby's workers
        s = d.wait_generation(2)
        rec = next(r for r in s["recoveries"] if r["from_generation"] == 1)
        assert rec["standby"] == {"result": "adopted", "adopted_ranks": [0, 1]}, rec
        victim = host_of_rank(d, hosts, 1)
        zombie = [w for w in inject.workers(hosts.head_address) if "-g2" in w["name"]]
        assert len(zombie) == 2, zombie
        seen = {}

        def short_partition() -> None:
            seen["partitioned"] = time.monotonic()
            hosts.partition(victim)
            while d.get("/readyz").json()["state"] != "recovering":
                assert time.monotonic() - seen["partitioned"] < 20, d.get("/readyz").json()
                time.sleep(0.2)
            time.sleep(2)  # the teardown's kills are asked for while the link is down
            hosts.heal(victim)
            seen["healed"] = time.monotonic()

        records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS, short_partition))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        deadline = time.monotonic() + 60  # both waits together, as before
        wait_actors_gone(hosts, "-g2", "the adopted zombie generation's actors")
        while left := set(w["pid"] for w in zombie) & set(hosts.pids(victim)):
            assert time.monotonic() < deadline, f"zombie worker processes still run on the healed host: {left}"
            time.sleep(1)
        s = d.status()
        assert s["state"] == "ready" and s["generation"] >= 3, s
        print(json.dumps({"partition_s": round(seen["healed"] - seen["partitioned"], 1),
                          "zombie_gone_after_heal_s": round(time.monotonic() - seen["healed"], 1)}))
        revive(hosts)
        stop_and_check(d, hosts)
    finally:
        if d.proc.poll() is None:
            d.kill()


def test_a_partition_with_no_capacity_left_waits_saying_why_then_uses_the_healed_host(tmp_path, hosts):
    """TP=2 on two hosts with no spare (the third host's node is down): a partition of rank 1's
    host leaves no capacity this host can reach. The daemon waits, ``/readyz`` naming the host
    it cannot reach, and builds on the host once the link is back; every stream continues exactly."""
    revive(hosts)
    d = tp2_daemon(tmp_path, hosts)
    try:
        d.wait_ready(400)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        victim = host_of_rank(d, hosts, 1)
        spare = next(i for i in range(3) if i not in {victim, host_of_rank(d, hosts, 0)})
        hosts.kill_node(spare)  # no capacity left beside the two hosts in use
        address = hosts.hosts[victim].address
        seen = {}

        def partition_wait_heal() -> dict:
            seen["partitioned"] = time.monotonic()
            hosts.partition(victim)
            landed = time.monotonic()
            while (why := d.get("/readyz").json().get("reason", "")).find(address) < 0:
                assert time.monotonic() - seen["partitioned"] < HANG_TIMEOUT_S + 60, why
                time.sleep(0.5)
            seen["reason"] = why
            seen["waiting"] = time.monotonic()
            assert d.get("/readyz").status_code == 503
            hosts.heal(victim)
            seen["healed"] = time.monotonic()
            while d.get("/readyz").status_code != 200:  # the node's supervisor: Ray may have marked it dead
                assert time.monotonic() - seen["healed"] < 180, d.get("/readyz").json()
                revive(hosts, only={victim})
                time.sleep(2)
            return {"monotonic": landed}  # the streams may finish while this waited for the recovery

        records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS, partition_wait_heal))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        assert "waiting for capacity" in seen["reason"] and "unreachable from this host" in seen["reason"], seen["reason"]
        s = d.status()
        assert s["state"] == "ready", s
        print(json.dumps({"waiting_reason": seen["reason"][:300],
                          "waiting_after_partition_s": round(seen["waiting"] - seen["partitioned"], 1),
                          "ready_after_heal_s": round(s["recoveries"][-1]["ready_monotonic"] - seen["healed"], 1)}))
        revive(hosts)
        stop_and_check(d, hosts)
    finally:
        if d.proc.poll() is None:
            d.kill()
