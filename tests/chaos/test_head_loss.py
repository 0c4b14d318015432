"""Loss of the Ray head of an existing cluster (issue 14, part 4), on a real ``ray start --head``.

The test SIGKILLs every process of the head mid-stream (GCS, raylet, agents, the workers) and,
in the first scenario, starts it again on the same port with ``ray start --head``: the daemon
must stay up (``/livez`` 200, ``/readyz`` 503), keep its parked streams, reconnect and rebuild,
and every client must read exactly the text of a fault-free run. In the second the head stays
down: the daemon exits 75 after ``ray.reconnect_timeout_s`` and leaves nothing behind.

Before this was built the daemon's in-process Ray driver was aborted by Ray's core worker when
the head came back (``WrongClusterID``), exit 1, every stream lost (docs/failure-handling.md, "Ray head loss").
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, RayHead
from chaos.load import as_reference, compare, run_with_fault

pytestmark = [pytest.mark.integration, pytest.mark.extended]

MAX_TOKENS = 400
STREAMS = 6


def start_daemon(workdir, head: RayHead, reconnect_timeout_s: float) -> Daemon:
    config = {
        "engine": {"max_model_len": 1024},
        "ray": {"address": head.address, "reconnect_timeout_s": reconnect_timeout_s},
        "supervisor": {"probe_interval_s": 1.0, "restart_backoff_initial_s": 0.2},
    }
    return Daemon(workdir, config, env=OPERATOR_ENV).start()


def batch(daemon: Daemon, fault=None):
    return asyncio.run(run_with_fault(daemon.base_url, STREAMS, MAX_TOKENS, fault))


def watch_while_lost(daemon: Daemon, seconds: float) -> list[tuple[int, int, str]]:
    """(/livez, /readyz, state) every 0.25 s for ``seconds``."""
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        live = daemon.get("/livez", timeout=5).status_code
        ready = daemon.get("/readyz?verbose", timeout=5)
        seen.append((live, ready.status_code, ready.json()["state"]))
        time.sleep(0.25)
    return seen


def test_head_lost_and_back_streams_continue_exactly(tmp_path, own_ray_head):
    head = own_ray_head  # this test stops and restarts it
    with start_daemon(tmp_path, head, reconnect_timeout_s=120) as daemon:
        daemon.wait_ready()
        before = daemon.wait_standby()  # the standby's workers go with the cluster too
        agent_before = before["ray"]["agent_pid"]
        assert before["ray"]["connected"] and agent_before
        ref = as_reference(batch(daemon)[0])
        timings = {}

        def lose_head_then_bring_it_back():
            t = timings["lost"] = time.monotonic()
            head.stop()  # SIGKILL of every head process, as a crashed node
            timings["stopped_s"] = time.monotonic() - t
            timings["while_lost"] = watch_while_lost(daemon, 6.0)
            timings["lost_status"] = daemon.status()
            t = time.monotonic()
            head.start()  # `ray start --head` on the same port: a new GCS (a new cluster id)
            timings["head_start_s"] = time.monotonic() - t
            timings["back"] = time.monotonic()

        records, _ = batch(daemon, lose_head_then_bring_it_back)
        summary = compare(records, ref)
        assert summary["failed"] == 0, [(r.status, r.error) for r in records if r.outcome != "ok"]
        assert summary["mismatched"] == 0, summary
        assert all(r.usage_completion_tokens == MAX_TOKENS for r in records)

        # While the head was gone: alive, not ready, recovering, the daemon never restarted.
        states = timings["while_lost"]
        assert all(live == 200 for live, _, _ in states), states
        assert all(ready == 503 and state == "recovering" for _, ready, state in states[4:]), states
        lost = timings["lost_status"]
        assert "ray cluster lost" in lost["reason"] and lost["ray"]["connected"] is False, lost
        assert lost["standby"]["state"] == "off" and lost["standby"]["workers"] == [], lost["standby"]
        assert daemon.proc.poll() is None

        after = daemon.wait_generation(before["generation"] + 1)
        rec = after["recoveries"][-1]
        assert rec["ok"] and rec["reason"] == "ray_lost", rec
        assert after["ray"]["connected"] and after["ray"]["agent_pid"] not in (None, agent_before), after["ray"]
        first_token = min(c for r in records for c in r.chunk_times if c > timings["back"])
        print(f"\nhead loss: head stopped in {timings['stopped_s']:.1f} s, `ray start --head` took "
              f"{timings['head_start_s']:.1f} s; head back -> first token {first_token - timings['back']:.1f} s; "
              f"recovery phases {rec['phases_s']}")
        # A new request on the new cluster, and the daemon's record on it is its own only.
        again, _ = batch(daemon)
        summary = compare(again, ref)
        # every new request served, each with exactly the fault-free text (not just none mismatched)
        assert len(again) == STREAMS and summary["ok"] == STREAMS and summary["failed"] == 0, (
            summary, [(r.status, r.error[:200]) for r in again if r.outcome != "ok"])
        assert summary["mismatched"] == 0 and all(r.text == ref[r.key].text for r in again), summary
        assert all(r.usage_completion_tokens == MAX_TOKENS for r in again)
        daemon.wait_standby()  # prepared again on the new cluster
        code, _ = daemon.stop(signal.SIGTERM)
        assert code == 0, daemon.tail()
        daemon.assert_nothing_left()
        assert inject.inspect(head.address) == {"placement_groups": [], "actors": []}


def test_head_not_back_before_the_deadline_exits_75(tmp_path, own_ray_head):
    head = own_ray_head  # this test stops it
    with start_daemon(tmp_path, head, reconnect_timeout_s=10) as daemon:
        daemon.wait_ready()
        daemon.remember()
        lost = time.monotonic()
        head.stop()
        try:
            code = daemon.proc.wait(60)
        except Exception:
            raise AssertionError(f"daemon still running 60 s after the head was lost:\n{daemon.tail()}")
        took = time.monotonic() - lost
        assert code == 75, daemon.tail()
        assert 10 <= took < 40, took
        events = [line.get("event") for line in daemon.log_lines()]
        assert "ray cluster lost" in events, events[-30:]
        daemon.assert_nothing_left()
        with pytest.raises(httpx.HTTPError):
            daemon.get("/livez", timeout=2)
