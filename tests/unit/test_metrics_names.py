"""The Grafana dashboard only queries series the daemon exports."""

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from health.metrics import SupervisorMetrics

ROOT = Path(__file__).resolve().parents[2]


def test_dashboard_queries_exported_series():
    exported = generate_latest(SupervisorMetrics(world_size=2).registry).decode()
    dash = json.loads((ROOT / "health" / "grafana" / "vllm-supervisor.json").read_text())
    names = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"vllm_supervisor_[a-z_]+", target["expr"]))
    assert len(names) >= 12
    for name in names:
        assert re.search(rf"^{name}[{{ ]", exported, re.M), name


def test_every_series_exists_before_any_event():
    m = SupervisorMetrics(world_size=2)
    m.set_replicas(2)
    text = generate_latest(m.registry).decode()
    for line in ('vllm_supervisor_state{state="starting"} 1.0', 'vllm_supervisor_worker_up{rank="1",replica="0"} 0.0',
                 'vllm_supervisor_restarts_total{reason="hang",replica="0"} 0.0',
                 'vllm_supervisor_requests_total{outcome="continued"} 0.0',
                 'vllm_supervisor_worker_deaths_total{cause="killed",replica="1"} 0.0',
                 'vllm_supervisor_replica_up{replica="1"} 0.0', 'vllm_supervisor_engine_generation{replica="1"} 0.0',
                 'vllm_supervisor_replica_restart_budget_spent{replica="1"} 0.0',
                 'vllm_supervisor_recovery_phase_duration_seconds_count{phase="detect",replica="1"} 0.0'):
        assert line in text, line
