"""A replica that can never be placed leaves the daemon serving (``--replicas 2`` on a Ray
head with one CPU: replica 1's placement group never fits). Replica 1 spends its own restart
budget and waits, reported in ``/readyz?verbose``, ``ctl status`` and the
``vllm_supervisor_replica_restart_budget_spent`` metric; replica 0 serves every request,
``/readyz`` stays 200; SIGTERM leaves nothing behind."""

from __future__ import annotations

import signal
import time

import pytest
from openai import OpenAI

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon
from tests.conftest import running_ray_head

pytestmark = [pytest.mark.integration, pytest.mark.extended]


@pytest.fixture
def one_cpu_head():
    with running_ray_head(num_cpus=1) as head:
        yield head


def budget_spent(daemon, replica: int) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(daemon.get("/metrics/supervisor").text):
        for s in fam.samples:
            if s.name == "vllm_supervisor_replica_restart_budget_spent" and s.labels["replica"] == str(replica):
                return s.value
    return None


def test_an_unplaceable_replica_leaves_the_daemon_serving(tmp_path, one_cpu_head):
    config = {"engine": {"tensor_parallel_size": 1, "max_model_len": 1024},
              "ray": {"address": one_cpu_head.address, "placement_timeout_s": 3},
              "supervisor": {"max_restarts": 1, "restart_backoff_initial_s": 0.2, "restart_backoff_max_s": 1}}
    with Daemon(tmp_path, config, env=OPERATOR_ENV, args=("--replicas", "2")).start() as d:
        d.wait_ready()
        deadline = time.monotonic() + 120
        while (rep := d.status()["replicas"][1])["state"] != "waiting" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rep["state"] == "waiting", (rep, d.tail())
        assert "placement group" in rep["last_error"] and rep["retry_in_s"] > 60, rep
        ready = d.get("/readyz?verbose")
        assert ready.status_code == 200 and ready.json()["state"] == "ready", ready.text
        assert ready.json()["replicas"][0]["state"] == "serving"
        assert budget_spent(d, 1) == 1.0 and budget_spent(d, 0) == 0.0
        ctl = d.full_status()
        assert [r["state"] for r in ctl["replicas"]] == ["serving", "waiting"], ctl["replicas"]
        assert {w["replica"] for w in ctl["workers"]} == {0}
        client = OpenAI(base_url=d.base_url + "/v1", api_key="none", max_retries=0)
        answers = [client.completions.create(model=d.status()["model"] if "model" in d.status() else ctl["model"],
                                             prompt="The capital of France is", max_tokens=24, temperature=0)
                   for _ in range(3)]
        assert all(a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 24 for a in answers)
        assert len({a.choices[0].text for a in answers}) == 1 and answers[0].choices[0].text  # served, deterministic
        assert d.status()["state"] == "ready" and d.proc.poll() is None  # still serving: not exit 3
        code, _ = d.stop(signal.SIGTERM)
        assert code == 0, d.tail()
        d.assert_nothing_left()
        assert inject.inspect(one_cpu_head.address) == {"placement_groups": [], "actors": []}
