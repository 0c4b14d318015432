"""``executor.engine.set_engine_environment``: what every engine build reads from the
environment, set only where the operator set nothing."""

from __future__ import annotations

import os

from executor import engine


def test_vllms_startup_plan_is_on_unless_the_operator_turned_it_off(monkeypatch):
    monkeypatch.setenv(engine.STARTUP_PLAN_VAR, "")  # restored after the test, whatever it sets
    monkeypatch.delenv(engine.STARTUP_PLAN_VAR)
    engine.set_engine_environment(1)
    assert os.environ[engine.STARTUP_PLAN_VAR] == "1"
    monkeypatch.setenv(engine.STARTUP_PLAN_VAR, "0")
    engine.set_engine_environment(1)
    assert os.environ[engine.STARTUP_PLAN_VAR] == "0"


def test_the_cpu_kv_size_is_the_configured_one_unless_the_operator_set_it(monkeypatch):
    monkeypatch.setattr(engine, "is_cpu_platform", lambda: True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    engine.set_engine_environment(3)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    engine.set_engine_environment(3)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "8"
