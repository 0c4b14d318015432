"""The operator's files: the systemd unit and its environment file, the Ray head unit and the
install notes, the Grafana dashboard and the Prometheus alert rules.

    vllm-supervisor assets                 # list them, each with where it is read from
    vllm-supervisor assets systemd-unit    # print one (systemd-unit, env-file, ...)
    vllm-supervisor assets --path grafana  # print its path instead

The same names work from a checkout (``make venv``'s editable install, or ``python -m
supervisor``) and from the installed wheel. In a checkout every file is read where it lives. The
wheel carries ``health/grafana/`` and ``health/alerts/`` as package data of ``health`` (so they
sit next to this package, as in the checkout) and ``systemd/`` as data files under
``<prefix>/share/vllm-supervisor/systemd/``: ``systemd`` is not made a Python package, since a
top-level ``systemd`` would shadow python-systemd. Those are found through the installed
distribution's file list (``importlib.metadata``), which holds for a venv, ``--user`` and
``--prefix`` installs alike.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

DIST = "vllm-supervisor"
SHARE = "share/vllm-supervisor/"
# The folder holding the top-level packages: the checkout, or site-packages for the wheel.
TOP = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Asset:
    name: str
    relpath: str  # in the checkout; the wheel keeps the same relative path (package data or share/)
    about: str


ASSETS = (
    Asset("systemd-unit", "systemd/vllm-supervisor.service", "the Type=notify systemd unit (/etc/systemd/system/)"),
    Asset("env-file", "systemd/vllm-supervisor.env", "its EnvironmentFile (/etc/vllm-supervisor/): VLLM_SERVE_ARGS"),
    Asset("ray-head-unit", "systemd/ray-head.service", "an example unit for a Ray head the daemon joins"),
    Asset("systemd-readme", "systemd/README.md", "the install steps for systemd, GPU hosts"),
    Asset("grafana", "health/grafana/vllm-supervisor.json", "the Grafana dashboard (import it)"),
    Asset("alerts", "health/alerts/vllm-supervisor.rules.yml", "the Prometheus alert rules (rule_files:)"),
)
BY_NAME = {a.name: a for a in ASSETS}


class AssetMissing(LookupError):
    pass


def _installed(relpath: str) -> Path | None:
    """``relpath`` among the installed distribution's data files (``share/vllm-supervisor/``)."""
    from importlib import metadata

    try:
        files = metadata.files(DIST) or []
    except metadata.PackageNotFoundError:
        return None
    want = SHARE + relpath
    for f in files:
        if f.as_posix().endswith(want):
            path = Path(f.locate()).resolve()
            if path.is_file():
                return path
    return None


def path(name: str) -> Path:
    """Where the asset ``name`` is read from; ``AssetMissing`` if this install does not carry it."""
    asset = BY_NAME.get(name)
    if asset is None:
        raise AssetMissing(f"unknown asset {name!r}; one of: {', '.join(BY_NAME)}")
    here = TOP / asset.relpath
    if here.is_file():
        return here
    found = _installed(asset.relpath)
    if found is not None:
        return found
    raise AssetMissing(f"{name}: {asset.relpath} is not in this install (looked in {TOP} and in the "
                       f"{DIST} distribution's {SHARE}); reinstall vllm-supervisor")


def text(name: str) -> str:
    return path(name).read_text()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-supervisor assets",
        description="Print an operator's file shipped with vllm-supervisor; without NAME, list them.",
        epilog="e.g. vllm-supervisor assets systemd-unit | sudo tee /etc/systemd/system/vllm-supervisor.service")
    parser.add_argument("name", nargs="?", choices=list(BY_NAME), metavar="NAME",
                        help="one of: " + ", ".join(BY_NAME))
    parser.add_argument("--path", action="store_true", help="print where the file is instead of its content")
    ns = parser.parse_args(argv)
    if ns.name is None:
        width = max(len(a.name) for a in ASSETS)
        for a in ASSETS:
            try:
                where = str(path(a.name))
            except AssetMissing:
                where = "(not in this install)"
            print(f"{a.name:<{width}}  {a.about}\n{'':<{width}}  {where}")
        return 0
    try:
        found = path(ns.name)
    except AssetMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if ns.path:
        print(found)
    else:
        sys.stdout.write(found.read_text())
    return 0
