"""The shipped alert rules on a real Prometheus (Debian's binary) scraping a real daemon (TP=1 on a
private Ray head, real vLLM): a worker is ``ray.kill``-ed (``chaos.inject``) and
VllmSupervisorRecovering is seen pending or firing through Prometheus's HTTP API
(``/api/v1/alerts``, polled; the ``ALERTS`` series through ``/api/v1/query`` keeps what a late poll
would miss), then inactive again (``/api/v1/rules``) once the daemon serves on the next generation.

Prometheus loads ``health/alerts/vllm-supervisor.rules.yml`` itself, unchanged: the recovery
alert's ``for:`` is 0m, so no rewritten copy is needed; only the scrape and evaluation
intervals are short (1 s, in this test's own prometheus.yml). Every other rule must load,
evaluate without error, and never fire on this run (some, like VllmSupervisorRecoveryTooLong,
go pending during the recovery: their ``for:`` is longer than it).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import yaml

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon
from chaos.prom import Prometheus

pytestmark = [pytest.mark.integration, pytest.mark.extended]

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "health" / "alerts" / "vllm-supervisor.rules.yml"
ALERT = "VllmSupervisorRecovering"
GRACE_S = 10  # after the daemon serves again: several 1 s scrapes and evaluations


def rule_states(prom: Prometheus) -> dict[str, dict]:
    return {r["name"]: r for r in prom.rules() if r.get("type") == "alerting"}


def history(prom: Prometheus) -> dict[str, dict]:
    """alertstate -> labels of ALERT in the last 10 minutes, from the ``ALERTS`` series that
    Prometheus writes at each evaluation where an alert is pending or firing: what the polls of
    ``/api/v1/alerts`` saw, kept even if a poll came too late."""
    out = {}
    for r in prom.query(f'max_over_time(ALERTS{{alertname="{ALERT}"}}[10m])') or []:
        labels = dict(r["metric"])
        out[labels.pop("alertstate")] = labels
    return out


def test_recovery_alert_fires_then_resolves(ray_head, tmp_path):
    names = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    config = {"engine": {"tensor_parallel_size": 1, "max_model_len": 1024},
              "ray": {"address": ray_head.address},
              "supervisor": {"probe_interval_s": 1.0, "restart_backoff_initial_s": 0.2}}
    (tmp_path / "daemon").mkdir()
    (tmp_path / "prometheus").mkdir()
    with Daemon(tmp_path / "daemon", config, env=OPERATOR_ENV).start() as daemon:
        daemon.wait_ready()
        daemon.wait_standby()  # the recovery adopts it; no standby preparing while we watch
        with Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{daemon.port}"], [RULES], interval="1s") as prom:
            instance = f"127.0.0.1:{daemon.port}"
            # every rule loaded and evaluated on real series without error, all quiet
            deadline = time.monotonic() + 60
            states: dict[str, dict] = {}
            while time.monotonic() < deadline:
                states = rule_states(prom)
                ready = prom.query('vllm_supervisor_state{state="ready"} == 1')
                if (ready and set(states) == set(names)
                        and all(r["health"] == "ok" and r.get("lastEvaluation", "").startswith("2") for r in states.values())):
                    break
                time.sleep(0.5)
            assert set(states) == set(names), (sorted(states), prom.tail())
            assert all(r["health"] == "ok" for r in states.values()), {n: r.get("lastError") for n, r in states.items()}
            time.sleep(3)  # a few evaluations on scraped data
            states = rule_states(prom)
            assert all(r["state"] == "inactive" for r in states.values()), {n: r["state"] for n, r in states.items()}

            inject.prepare(ray_head.address)
            generation = daemon.status()["generation"]
            try:
                killed = inject.kill_worker(ray_head.address, rank=0)
            finally:
                inject.disconnect()  # a driver that loses its GCS aborts the whole test process
            seen: list[tuple[float, str, dict]] = []  # (s after the kill, state, alert) of ALERT
            fired_other: list[dict] = []
            back_at = inactive_at = None
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                now = time.monotonic() - killed["monotonic"]
                for alert in prom.alerts():
                    name = alert["labels"]["alertname"]
                    if name == ALERT:
                        seen.append((round(now, 2), alert["state"], alert))
                    elif alert["state"] == "firing":
                        fired_other.append(alert)
                if back_at is None:
                    s = daemon.status()
                    if s["state"] == "ready" and s["generation"] > generation:
                        back_at = round(now, 2)
                elif rule_states(prom)[ALERT]["state"] == "inactive" and not any(
                        a["labels"]["alertname"] == ALERT for a in prom.alerts()):
                    if seen or history(prom):
                        inactive_at = round(now, 2)
                        break
                    if now - back_at > GRACE_S:
                        break  # recovered, and the alert never came: it will not now
                time.sleep(0.25)

            recorded = history(prom)
            timeline = (f"killed {killed['killed']}; {ALERT} first seen {seen[0][1] if seen else None} at "
                        f"{seen[0][0] if seen else None} s, last seen at {seen[-1][0] if seen else None} s "
                        f"(ALERTS series: {sorted(recorded)}); daemon ready on the next generation at {back_at} s; "
                        f"rule inactive at {inactive_at} s")
            print(timeline)
            assert seen or recorded, f"{ALERT} never pending or firing: {timeline}\n{daemon.tail(20)}"
            assert {state for _, state, _ in seen} | set(recorded) <= {"pending", "firing"}
            labels = seen[0][2]["labels"] if seen else next(iter(recorded.values()))
            assert labels == {"alertname": ALERT, "job": "vllm-supervisor", "instance": instance,
                              "replica": "0", "severity": "info"}, labels
            if seen:
                assert seen[0][2]["annotations"]["runbook"].endswith("docs/alerts.md#vllmsupervisorrecovering")
            assert back_at is not None, f"daemon not ready on generation {generation + 1}: {timeline}\n{daemon.tail()}"
            assert inactive_at is not None, f"{ALERT} not resolved after the recovery: {timeline}"
            assert not fired_other, [(a["labels"], a["state"]) for a in fired_other]
        code, _ = daemon.stop(signal.SIGTERM)
        assert code == 0, daemon.tail()
