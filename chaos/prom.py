"""Prometheus for the tests: Debian's ``prometheus`` package (``prometheus`` and ``promtool``),
installed when missing, and a real Prometheus server run in a scratch directory.

The server gets its own config (scrape and evaluation intervals, scrape targets, rule files),
listens on a free loopback port, and is asked over its HTTP API (``/api/v1/query``,
``/api/v1/alerts``, ``/api/v1/rules``). Nothing is read from the user's ``HOME``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

import httpx


def ensure_prometheus() -> None:
    """Debian's prometheus package (prometheus + promtool), installed when missing."""
    if shutil.which("promtool") and shutil.which("prometheus"):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
                   check=True, env=env, capture_output=True, timeout=900)


def promtool(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``promtool ARGS`` (installed first when missing); output captured as text."""
    ensure_prometheus()
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A real Prometheus server scraping ``targets`` (``host:port``) as job ``job`` and
    evaluating ``rule_files``, every ``interval`` (e.g. ``"1s"``)."""

    def __init__(self, workdir: Path, targets: Iterable[str], rule_files: Iterable[Path] = (),
                 job: str = "vllm-supervisor", interval: str = "1s"):
        self.workdir = Path(workdir)
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.config = self.workdir / "prometheus.yml"
        rules = "".join(f"  - {Path(p).resolve()}\n" for p in rule_files)
        self.config.write_text(
            f"global: {{scrape_interval: {interval}, evaluation_interval: {interval}}}\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n"
            + f"  - job_name: {job}\n    static_configs: [{{targets: {list(targets)!r}}}]\n"
        )
        self.log_path = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90) -> "Prometheus":
        ensure_prometheus()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/-/ready", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"prometheus not ready within {timeout_s} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None:
            self._log.close()

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def api(self, path: str, **params: str) -> Any:
        """``data`` of one API answer; None when Prometheus does not answer 200."""
        try:
            r = httpx.get(f"{self.base_url}/api/v1/{path}", params=params, timeout=5)
        except httpx.HTTPError:
            return None
        return r.json()["data"] if r.status_code == 200 else None

    def query(self, expr: str) -> list | None:
        data = self.api("query", query=expr)
        return None if data is None else data["result"]

    def alerts(self) -> list[dict]:
        """Every active alert (``state`` pending or firing), from ``/api/v1/alerts``."""
        data = self.api("alerts")
        return [] if data is None else data["alerts"]

    def rules(self) -> list[dict]:
        """Every loaded rule with its state (inactive, pending, firing) and health, from ``/api/v1/rules``."""
        data = self.api("rules")
        return [] if data is None else [r for g in data["groups"] for r in g["rules"]]
