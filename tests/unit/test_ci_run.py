"""``.ci/run``'s order and its time budget for the extended subset, with ``make`` and the venv's
python replaced by scripts that only record their arguments (the real ones are CI itself)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, until_min: str) -> tuple[list[str], str, Path]:
    tree = tmp_path / "clone"
    (tree / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", tree / ".ci" / "run")
    calls = tmp_path / "calls"
    homes = tmp_path / "homes"
    for path, name in ((tree / ".venv" / "bin" / "python", "python"), (tmp_path / "bin" / "make", "make")):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Each call records its arguments and the HOME it was given.
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\necho "$HOME" >> {homes}\n')
        path.chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "CI_EXTENDED_UNTIL_MIN": until_min,
           "TMPDIR": str(tmp_path)}
    out = subprocess.run(["bash", str(tree / ".ci" / "run")], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return calls.read_text().splitlines(), out, Path(homes.read_text().splitlines()[0])


def test_with_time_left_ci_runs_make_test_the_smoke_then_the_extended_subset(tmp_path):
    calls, out, home = _run(tmp_path, "45")
    assert calls[0] == "make test"
    assert calls[1] == "python .ci/smoke.py make-run systemd"
    assert calls[2].startswith("python -m pytest -m extended tests/chaos/test_real_hosts.py")
    assert "test_install.py::test_wheel_builds_installs_and_serves" in calls[2]
    assert "the extended subset: 0 min spent, under 45" in out
    assert not home.exists(), "the temporary HOME is removed when CI ends"


def test_past_its_budget_ci_leaves_the_subset_out_saying_so_and_still_passes(tmp_path):
    calls, out, home = _run(tmp_path, "-1")
    assert calls == ["make test", "python .ci/smoke.py make-run systemd"]
    assert "the extended subset NOT RUN" in out and "make extended" in out
    assert not home.exists()
