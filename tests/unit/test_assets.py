"""``vllm-supervisor assets``: each operator's file printed from the checkout, and each one carried by
the wheel (pyproject's package data or data files name it). The wheel itself is built, installed and
asked by ``tests/integration/test_install.py`` (extended)."""

import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from supervisor import assets
from supervisor.cli import main

ROOT = Path(__file__).resolve().parents[2]
NAMES = [a.name for a in assets.ASSETS]


@pytest.mark.parametrize("name", NAMES)
def test_assets_prints_each_file_from_the_checkout(name, capsys):
    asset = assets.BY_NAME[name]
    assert main(["assets", name]) == 0
    printed = capsys.readouterr().out
    assert printed == (ROOT / asset.relpath).read_text() and printed.strip()
    assert main(["assets", "--path", name]) == 0
    assert Path(capsys.readouterr().out.strip()) == ROOT / asset.relpath


def test_the_operators_files_are_all_there():
    assert {"systemd-unit", "env-file", "grafana", "alerts"} <= set(NAMES)
    assert assets.text("systemd-unit").startswith("# vllm-supervisor under systemd")
    assert "[Service]" in assets.text("systemd-unit") and "VLLM_SERVE_ARGS" in assets.text("env-file")
    assert '"panels"' in assets.text("grafana") and "groups:" in assets.text("alerts")


def test_listing_names_each_asset_and_where_it_is(capsys):
    assert main(["assets"]) == 0
    listed = capsys.readouterr().out
    for a in assets.ASSETS:
        assert a.name in listed and str(ROOT / a.relpath) in listed
    assert "not in this install" not in listed


def test_unknown_or_missing_asset_is_an_error(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["assets", "no-such-asset"])
    assert exit_.value.code == 2
    monkeypatch.setattr(assets, "TOP", tmp_path)  # neither in a checkout nor in the distribution's data files
    monkeypatch.setattr(assets, "_installed", lambda relpath: None)
    assert main(["assets", "systemd-unit"]) == 1
    assert "systemd/vllm-supervisor.service is not in this install" in capsys.readouterr().err


def test_the_wheel_carries_each_asset():
    """pyproject's [tool.setuptools] package-data (relative to its package) or data-files (to
    share/vllm-supervisor/) matches every asset at the path assets.py looks for it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = setuptools.get("package-data", {})
    data_files = setuptools.get("data-files", {})
    for a in assets.ASSETS:
        top, _, rest = a.relpath.partition("/")
        as_package_data = any(fnmatch(rest, g) for g in package_data.get(top, []))
        as_data_file = any(a.relpath in files and target == (assets.SHARE + a.relpath).rsplit("/", 1)[0]
                           for target, files in data_files.items())
        assert as_package_data or as_data_file, f"{a.relpath} ({a.name}) is not shipped in the wheel"
        if as_package_data:
            assert (ROOT / top / "__init__.py").is_file(), f"{top} is not a package"
    assert not (ROOT / "systemd" / "__init__.py").exists(), "a top-level `systemd` package would shadow python-systemd"


def test_command_line_lists_assets():
    out = subprocess.run([sys.executable, "-m", "supervisor", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "assets" in out.stdout
