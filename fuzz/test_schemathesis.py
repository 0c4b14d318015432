"""schemathesis against the real daemon's OpenAPI schema (``make chaos``; not in ``make test``:
a fuzz run keeps finding new 500s inside vLLM's own front, see docs/security.md, "Tested"). Shares the daemon
fixture of ``tests/integration/test_fuzz.py``."""

from __future__ import annotations

import json
import subprocess

from chaos.harness import BIN
from tests.integration.test_fuzz import FUZZ_S, ROOT, daemon, still_serving_exactly  # noqa: F401 (fixture)


def test_schemathesis_finds_no_server_error(daemon, tmp_path):
    d, ref = daemon
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


