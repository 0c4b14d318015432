"""schemathesis against the real daemon's OpenAPI schema (``make chaos``; not in ``make test``:
a fuzz run keeps finding new 500s inside vLLM's own front, see docs/security.md, "Tested"), on a daemon of
its own; the hand-written hostile requests of ``tests/integration/hostile.py`` run in ``make test``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from chaos.harness import BIN, Daemon
from tests.integration.hostile import hostile_ref, still_serving_exactly  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
FUZZ_S = int(os.environ.get("VLLM_SUPERVISOR_FUZZ_S", "150"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # No warm standby: what is fuzzed is the request path (the front, vLLM's app, the engine),
    # which the standby is not on; its build would only compete with the requests for the cores.
    config = {"server": {"max_body_bytes": 65536}, "supervisor": {"standby": "none"}}
    with Daemon(tmp_path_factory.mktemp("fuzz"), config).start() as d:
        d.wait_ready()
        yield d
        code, _ = d.stop()
        assert code == 0, d.tail()
        d.assert_nothing_left()


def test_schemathesis_finds_no_server_error(daemon, hostile_ref, tmp_path):
    d, ref = daemon, hostile_ref
    report_dir = tmp_path / "report"
    out = subprocess.run(
        [str(BIN / "st"), "--config-file", str(ROOT / "fuzz" / "schemathesis.toml"), "run", f"{d.base_url}/openapi.json",
         "--checks", "not_a_server_error", "--max-time", str(FUZZ_S), "--workers", "1", "--request-timeout", "60",
         "--seed", "1", "--suppress-health-check", "all", "--report", "json", "--report-dir", str(report_dir),
         "--no-color"],
        capture_output=True, text=True, timeout=FUZZ_S + 600, cwd=tmp_path,
    )
    report = json.loads(next(report_dir.glob("*.json")).read_text())
    print("\nschemathesis:", json.dumps({k: report.get(k) for k in ("operations", "test_cases", "failures", "errors")}))
    assert report["failures"] == [], out.stdout[-6000:]
    assert out.returncode == 0, out.stdout[-6000:]
    log = d.log_path.read_text(errors="replace")
    assert "Exception in ASGI application" not in log, log[log.find("Exception in ASGI application") - 300:][:4000]
    still_serving_exactly(d, ref)


