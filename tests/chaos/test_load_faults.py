"""Load through faults, the short form of ``python -m chaos.stress`` (``make chaos`` runs it
with 256 clients): 64 concurrent clients streaming mixed requests through a ``ray.kill`` of a worker, a SIGKILL
of the engine core and a SIGSTOPped worker (a hang), with an admission burst during every
recovery and clients that hang up, before the faults and while their stream is parked in a
recovery. ``chaos.stress.failures`` states the checks: every request exact, or rejected with a
503 + ``Retry-After`` before any token (a stream that ends in an error after tokens fails), a
floor of exact answers and a cap on rejections; none lost, duplicated or past its deadline;
the admission limit reached in the bursts; each recovery's reason the fault's; hung-up clients
dropped by the daemon and aborted in the engine; the daemon's RSS/fds/threads bounded; it
stops clean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.stress import EXPECTED_REASON, failures

pytestmark = [pytest.mark.integration, pytest.mark.extended]

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
    fails = failures(report)
    assert not fails, "\n".join(fails)
    o = report["outcome"]
    assert [f["reason"] for f in report["faults"]] == [EXPECTED_REASON[f] for f in report["faults_planned"]], report["faults"]
    assert o["lost"] == 0 and o["past_deadline"] == 0 and o["mismatched"] == 0 and o["tokens_duplicated"] == 0, o
    assert o["failed_after_tokens"] == 0 and not o["other_errors"], o
    assert o["ok_exact"] + o["retriable_errors"] + o["hung_up"] == o["requests"], o
    assert o["bursts"]["rejected_503"] >= report["burst_extra"], o["bursts"]
    assert o["hang_up_check"]["ok"] and o["after_load"]["ok"], (o["hang_up_check"], o["after_load"])
    assert all(f["hang_ups"]["ok"] for f in report["faults"]), report["faults"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
