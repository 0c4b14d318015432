"""Crash-only daemon: SIGKILL of the real daemon mid-stream (an OOM kill, a crash) leaves
nothing of it running, and the next start on the same port cleans what it left and serves.

Before the reaper (``executor/reaper.py``) a SIGKILLed daemon left its private cluster's
``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` running for 90 s or more, and its
rings in ``/dev/shm`` for good.

The private cluster's case ends ``tests/integration/test_serving.py``'s daemon (a daemon start
fewer in ``make test``): ``test_sigkill_leaves_nothing_and_the_next_start_cleans_serves_and_exits_zero_on_sigterm``.
Here, the extended variant on an operator's cluster, and the steps both use."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from chaos import inject
from chaos.harness import Daemon
from chaos.load import as_reference, compare, run_with_fault
from tests.chaos.test_recovery import MAX_TOKENS, start_daemon, stop_leaves_nothing

pytestmark = pytest.mark.integration

STREAMS = 4
SETTLE_S = 15.0  # the reaper needs < 2 s here; Ray's agents alone took > 45 s to give up


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def serve_reference(daemon: Daemon, max_tokens: int = MAX_TOKENS) -> dict:
    return as_reference(asyncio.run(run_with_fault(daemon.base_url, STREAMS, max_tokens))[0])


def crash_mid_stream(daemon: Daemon, max_tokens: int = MAX_TOKENS) -> tuple[float, list[str]]:
    """SIGKILL the daemon while ``STREAMS`` streams run; returns (seconds until none of its
    processes and no new segment of its is left, the command lines of its processes)."""
    daemon.wait_standby()  # the fork server and the standby actor are up: the most to leave
    killed_at, titles = [], []

    def fault():
        titles.extend(cmdline(pid) for pid, _ in daemon.remember())
        killed_at.append(time.monotonic())
        os.kill(daemon.proc.pid, signal.SIGKILL)
        return {}

    records, _ = asyncio.run(run_with_fault(daemon.base_url, STREAMS, max_tokens, fault))
    assert daemon.proc.wait(10) == -signal.SIGKILL
    # the streams were cut (the daemon is gone), not silently completed
    assert all(r.outcome == "error" or r.finish_reason is None for r in records)
    daemon.assert_nothing_left(settle_s=SETTLE_S)
    return time.monotonic() - killed_at[0], titles


def assert_serves_exactly(daemon: Daemon, ref: dict, max_tokens: int = MAX_TOKENS) -> None:
    records, _ = asyncio.run(run_with_fault(daemon.base_url, STREAMS, max_tokens))
    summary = compare(records, ref)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, summary


@pytest.mark.extended
def test_sigkill_on_an_existing_cluster_leaves_no_ray_state_and_the_next_start_cleans(tmp_path, ray_head):
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with start_daemon(tmp_path / "first", ray_head, tp=1) as first:
        first.wait_ready()
        ref = serve_reference(first)
        pred_id = first.daemon_id
        took, _ = crash_mid_stream(first)
        # Ray frees a dead driver's groups and actors, and the engine core's job with it
        waited_from = time.monotonic()
        deadline = waited_from + 60
        while (left := inject.inspect(ray_head.address, match=pred_id)) != {"placement_groups": [], "actors": []}:
            assert time.monotonic() < deadline, f"Ray state left by the crashed daemon: {left}"
            time.sleep(0.5)
        print(f"\nSIGKILL of the daemon (existing cluster): local processes gone {took:.1f} s after the "
              f"kill, its Ray state {took + time.monotonic() - waited_from:.1f} s after")

    # What Ray would not free by itself (a detached actor, a detached group named as the
    # crashed daemon's) is removed by the next daemon on the port before it builds.
    import ray

    actor = ray.remote(num_cpus=0)(type("Leftover", (), {"ping": lambda self: 1}))
    actor.options(name=f"vllm_Worker_{pred_id}-g7", namespace="vllm-supervisor", lifetime="detached").remote()
    pg = ray.util.placement_group([{"CPU": 0.01}], name=f"{pred_id}-pg", lifetime="detached")
    ray.get(pg.ready(), timeout=30)
    assert len(inject.inspect(ray_head.address, match=pred_id)["actors"]) == 1

    with start_daemon(tmp_path / "second", ray_head, tp=1, port=first.port) as second:
        second.wait_ready()
        removed = [line for line in second.log_lines() if line.get("event") == "removed a crashed predecessor's Ray leftovers"]
        assert removed and removed[0]["actors"] == [f"vllm_Worker_{pred_id}-g7"], second.tail()
        assert len(removed[0]["placement_groups"]) == 1
        assert inject.inspect(ray_head.address, match=pred_id) == {"placement_groups": [], "actors": []}
        assert_serves_exactly(second, ref)
        stop_leaves_nothing(second, ray_head)
