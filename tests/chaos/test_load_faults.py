"""Load through faults, the short form of ``python -m chaos.stress`` (``make chaos`` runs it
with 256 clients): 64 concurrent clients streaming mixed requests through a ``ray.kill`` of a worker, a SIGKILL
of the engine core and a SIGSTOPped worker (a hang), with an admission burst during every
recovery and clients that hang up. Every request ends exactly as the fault-free run or with
the documented retriable 503; none lost, duplicated or past its deadline; hung-up clients
are aborted in the engine; the daemon stops clean. ``chaos/stress.py`` states the checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_64_clients_through_three_faults(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "chaos.stress", "--streams", "64", "--deadline-s", "300", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    print(out.stdout[-4000:])
    report_path = tmp_path / "stress-report.json"
    assert report_path.exists(), out.stderr[-4000:]
    report = json.loads(report_path.read_text())
    o = report["outcome"]
    assert len(report["faults"]) == 3 and all(f["streams_running"] > 0 for f in report["faults"])
    assert o["lost"] == 0 and o["past_deadline"] == 0 and o["mismatched"] == 0 and o["tokens_duplicated"] == 0, o
    assert o["ok_exact"] + o["retriable_errors"] + o["hung_up"] == o["requests"], o
    assert o["hang_up_check"]["ok"], o["hang_up_check"]
    assert o["bursts"]["rejected_503"] == o["bursts"]["rejected_with_retry_after"], o["bursts"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
