"""``executor.engine.set_engine_environment``: what every engine build reads from the
environment, set only where the operator set nothing."""

from __future__ import annotations

import copy
import os

from executor import engine
from executor.events import ADDITIONAL_CONFIG_KEY


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


def built_config(monkeypatch, args, **spec):
    """``build_engine`` on the demo model's real flags and vLLM's real config, with
    ``AsyncLLM.from_vllm_config`` standing in (no engine starts): the config it is given."""
    from vllm.v1.engine.async_llm import AsyncLLM

    for var in ("VLLM_CPU_KVCACHE_SPACE", engine.STARTUP_PLAN_VAR):  # set by build_engine: restored after
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(AsyncLLM, "from_vllm_config", classmethod(lambda cls, cfg, **_: cfg))
    return engine.build_engine(engine.EngineSpec(args=copy.deepcopy(args), generation=2, instance_id="t-g2",
                                                 event_endpoint="", placement_group=None, **spec))


def test_a_build_without_standby_workers_starts_its_own_once_its_config_is_made(monkeypatch):
    """``EngineSpec.start_workers`` (``StandbyWorkers.starter``): called with the build's own
    config, before the engine core starts; its namespace is the one the executor adopts from.
    Not called when standby workers were claimed, nor for an executor that cannot adopt."""
    from tests.unit.test_http_front_fake_engine import demo_front

    args, _ = demo_front()
    given = []

    replicas_seen = []

    def start(cfg):
        given.append(cfg)
        replicas_seen.append(cfg.additional_config[ADDITIONAL_CONFIG_KEY]["replicas"])  # the workers' binding reads it
        return "early-ns"

    cfg = built_config(monkeypatch, args, start_workers=start, replicas=2)
    assert given == [cfg] and cfg.instance_id == "t-g2" and replicas_seen == [2]
    assert cfg.additional_config[ADDITIONAL_CONFIG_KEY]["standby_namespace"] == "early-ns"

    cfg = built_config(monkeypatch, args, start_workers=start, standby_namespace="standby-ns")
    assert len(given) == 1 and cfg.additional_config[ADDITIONAL_CONFIG_KEY]["standby_namespace"] == "standby-ns"

    cfg = built_config(monkeypatch, args, start_workers=lambda cfg: None)  # could not start them: vLLM creates them
    assert cfg.additional_config[ADDITIONAL_CONFIG_KEY]["standby_namespace"] is None

    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")  # the compiled-graph executor adopts nothing
    cfg = built_config(monkeypatch, args, start_workers=start)
    assert len(given) == 1 and cfg.additional_config[ADDITIONAL_CONFIG_KEY]["standby_namespace"] is None
