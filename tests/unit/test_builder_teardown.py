"""``EngineBuilder.teardown``: a failed engine core is killed before vLLM's shutdown, which then
finds it gone instead of waiting for it after SIGTERM; a planned stop's core gets vLLM's
graceful shutdown. Real child processes stand in for the engine core."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from executor import engine as engine_mod
from executor.procfs import running
from supervisor.builder import EngineBuilder


class NoCluster:
    cluster = None


def builder() -> EngineBuilder:
    return EngineBuilder(settings=None, engine_args=None, daemon_id="d", event_endpoint="", ray=NoCluster())


@pytest.fixture()
def core():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def teardown_seen(monkeypatch, core, failed: bool, planned: bool = False) -> dict:
    seen: dict = {}

    def shutdown(engine, timeout_s):
        try:  # reap it if it was killed (a zombie is not running); a live one stays
            core.wait(0.5)
        except subprocess.TimeoutExpired:
            pass
        seen.update(core_running=running(core.pid), timeout_s=timeout_s)

    monkeypatch.setattr(engine_mod, "engine_core_pids", lambda engine: [core.pid])
    monkeypatch.setattr(engine_mod, "engine_worker_pids", lambda engine: [])
    monkeypatch.setattr(engine_mod, "shutdown_engine", shutdown)
    gen = SimpleNamespace(number=1, engine=object(), failed=failed, planned=planned, replica=0, shm_before=None)
    builder().teardown(gen)
    return seen


def test_a_failed_engine_core_is_killed_before_vllms_shutdown(monkeypatch, core):
    seen = teardown_seen(monkeypatch, core, failed=True)
    assert seen["core_running"] is False
    assert core.wait(5) == -9


def test_a_planned_rebuild_gives_the_core_vllms_graceful_shutdown(monkeypatch, core):
    seen = teardown_seen(monkeypatch, core, failed=True, planned=True)
    assert seen == {"core_running": True, "timeout_s": 5.0}
