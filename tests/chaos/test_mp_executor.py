"""Supervision with vLLM's single-node ``mp`` executor (no Ray): a worker process is
SIGKILLed mid-stream; the streams continue exactly on a new engine; nothing is left."""

from __future__ import annotations

import asyncio
import signal

import pytest

from chaos import inject
from chaos.harness import Daemon
from chaos.load import PROMPTS, as_reference, compare, run_with_fault

pytestmark = [pytest.mark.integration, pytest.mark.extended]


def test_mp_worker_sigkill_mid_stream(tmp_path):
    # TP=1: the CPU build binds each local worker to its own NUMA node and this machine has one.
    config = {"engine": {"executor": "mp", "tensor_parallel_size": 1, "max_model_len": 1024},
              "supervisor": {"probe_interval_s": 1.0}}
    d = Daemon(tmp_path, config).start()
    try:
        d.wait_ready()
        ref_records, _ = asyncio.run(run_with_fault(d.base_url, len(PROMPTS), 400))
        ref = as_reference(ref_records)
        records, info = asyncio.run(run_with_fault(
            d.base_url, 6, 400, lambda: inject.signal_local_worker(d.proc.pid, signal.SIGKILL, index=0)))
        summary = compare(records, ref)
        assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, [r.error for r in records])
        s = d.get("/readyz?verbose").json()
        assert s["state"] == "ready" and s["generation"] == 2
        rec = s["recoveries"][-1]
        # The executor's own report names the dead worker (even when a request's
        # EngineDeadError reached the supervisor first: the report refines that cause).
        assert rec["reason"] == "worker_death", rec
        assert "worker process" in rec["detail"] and "exited with -9" in rec["detail"], rec
        print(f"\nmp: detection {(rec['detected_monotonic'] - info['monotonic']) * 1000:.0f} ms "
              f"(refined from {rec.get('refined_from')}), engine start {rec['phases_s']['engine_start']:.1f} s")
        code, _ = d.stop(signal.SIGTERM)
        assert code == 0, d.tail()
        d.assert_nothing_left()
    finally:
        if d.proc.poll() is None:
            d.kill()
