"""The shipped Prometheus alert rules (``health/alerts/vllm-supervisor.rules.yml``): valid for
``promtool check rules``, every rule unit-tested by ``promtool test rules`` on synthetic series,
every rule complete (threshold, ``for:``, severity, summary, description, runbook linking a
section of docs/alerts.md), and every series and label value they read one that the daemon's
metrics registry really exports: this is what fails when a metric is renamed.

promtool is Debian's ``prometheus`` package, apt-installed when missing (``chaos.prom``).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from chaos.prom import promtool
from health.metrics import SupervisorMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "health" / "alerts"
RULES = ALERTS / "vllm-supervisor.rules.yml"
RULE_TESTS = ALERTS / "vllm-supervisor.rules.test.yml"
DOC = ROOT / "docs" / "alerts.md"

# Series that Prometheus itself makes for every scrape target, not the daemon.
PROMETHEUS_SERIES = {"up"}
SEVERITIES = {"info", "warning", "critical"}

# PromQL words that are not metric names: aggregations, keywords, functions (followed by "(").
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan"}


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: every identifier left once strings, label
    matchers, grouping label lists, ranges/durations, numbers, keywords and function or
    aggregation names (an identifier followed by ``(``) are taken out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\boffset\s+-?\d+[smhdwy]", " ", e)
    e = re.sub(r"\b\d+(\.\d+)?([eE][+-]?\d+)?[smhdwy]?\b", " ", e)  # numbers and durations
    e = re.sub(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\s*\(", " (", e)  # function and aggregation names
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e) if w.lower() not in KEYWORDS}


def selectors(expr: str) -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every label matcher written ``metric{…}``."""
    out = []
    for metric, body in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", expr):
        for label, op, value in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"', body):
            out.append((metric, label, op, value))
    return out


def exported() -> dict[str, dict[str, set[str]]]:
    """Sample name -> label -> the values it takes, of the registry the daemon builds
    (``supervisor/daemon.py``: ``SupervisorMetrics(world_size, registry)``), two replicas, and the
    standby's series, which ``supervisor.standby.Standby`` sets when the daemon builds it."""
    m = SupervisorMetrics(world_size=2)
    m.set_replicas(2)
    m.set_standby("off")
    out: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for sample in family.samples:
            labels = out.setdefault(sample.name, {})
            for k, v in sample.labels.items():
                labels.setdefault(k, set()).add(v)
    return out


def test_metric_name_parser():
    expr = ('round(sum by (job, instance) (increase(vllm_supervisor_restarts_total{reason=~"a|b"}[10m] offset 5m))) '
            '>= 4 and on (job) (max without (state) (vllm_supervisor_state{state="ready"}) == 0) '
            'unless ignoring(replica) group_left(x) up{job="vllm-supervisor"} > bool 1e3 or foo:bar_rate5m')
    assert metric_names(expr) == {"vllm_supervisor_restarts_total", "vllm_supervisor_state", "up", "foo:bar_rate5m"}
    assert selectors(expr) == [("vllm_supervisor_restarts_total", "reason", "=~", "a|b"),
                               ("vllm_supervisor_state", "state", "=", "ready"), ("up", "job", "=", "vllm-supervisor")]


def test_promtool_check_rules():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout, out.stdout


def test_promtool_test_rules():
    out = promtool("test", "rules", str(RULE_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def test_rules_read_only_series_the_daemon_exports():
    """Every metric in every expression is one the daemon's registry exports (or Prometheus's
    own ``up``), and every label value it matches is one that series takes."""
    series = exported()
    used: set[str] = set()
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        # every vllm_supervisor_* token, whatever the parser made of the expression
        assert set(re.findall(r"vllm_supervisor_[a-zA-Z0-9_]+", rule["expr"])) <= names, rule["alert"]
        for name in names - PROMETHEUS_SERIES:
            assert name in series, f"{rule['alert']}: {name} is not a series the daemon exports"
        for metric, label, op, value in selectors(rule["expr"]):
            if metric in PROMETHEUS_SERIES:
                continue
            values = series[metric].get(label)
            assert values is not None, f"{rule['alert']}: {metric} has no label {label}"
            wanted = value.split("|") if op in ("=~", "!~") else [value]
            for v in wanted:
                assert re.fullmatch(r"[a-zA-Z0-9_]+", v), f"{rule['alert']}: {label}{op}\"{value}\" is not a plain list"
                assert v in values, f"{rule['alert']}: {metric}{{{label}=\"{v}\"}} is never exported (values: {sorted(values)})"
        used |= names
    assert used & PROMETHEUS_SERIES == {"up"}


def test_every_rule_is_complete_and_documented():
    doc = DOC.read_text()
    anchors = {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+\s+(.*)$", doc, re.M)}
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)), names
    for rule in rules():
        name = rule["alert"]
        assert re.search(r"(==|!=|>=|<=|>|<)\s*[\d.]+", rule["expr"]), f"{name}: no threshold"
        assert "for" in rule and re.fullmatch(r"\d+[smh]", rule["for"]), f"{name}: no for:"
        assert rule["labels"]["severity"] in SEVERITIES, name
        ann = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(ann), name
        link = f"docs/alerts.md#{name.lower()}"
        assert ann["runbook"].endswith(link) and "\n" not in ann["runbook"], f"{name}: runbook must end with {link}"
        assert name.lower() in anchors, f"docs/alerts.md has no section {name}"
        section = doc.split(f"## {name}", 1)[1].split("\n## ", 1)[0]
        assert f"`for: {rule['for']}`" in section, f"docs/alerts.md#{name.lower()} does not state for: {rule['for']}"


def test_every_rule_fires_and_stays_quiet_in_the_unit_tests():
    """Each alert has at least one eval where it fires and one where it must not."""
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in rules()}
    assert names - fires == set(), f"never seen firing: {sorted(names - fires)}"
    assert names - quiet == set(), f"never seen quiet: {sorted(names - quiet)}"


def test_tested_alert_names_exist():
    """promtool passes silently for an alertname that no rule has: every tested name is real."""
    tested = {c["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for c in case.get("alert_rule_test", [])}
    assert tested - {r["alert"] for r in rules()} == set()
