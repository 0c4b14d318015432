"""Operating the daemon: API key and body limits, /metrics checked by promtool and scraped by
a real Prometheus, the control CLI, SIGHUP reload, and the systemd units."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from chaos.harness import BIN, Daemon, free_port
from chaos.load import PROMPTS, as_reference, compare, run_with_fault
from chaos.prom import ensure_prometheus

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
KEY = "sekret-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, notify_socket):
    workdir = tmp_path_factory.mktemp("ops")
    config = {"engine": {"tensor_parallel_size": 1, "max_model_len": 1024},
              "server": {"api_key": KEY, "max_body_bytes": 65536},
              # A short drain: requests still running when it ends are continued on the new
              # engine, which is what the restart and reload tests below are about.
              "supervisor": {"drain_timeout_s": 0.5, "probe_interval_s": 1.0,
                             "control_socket": str(workdir / "control.sock")}}
    with Daemon(workdir, config, env={"NOTIFY_SOCKET": notify_socket[0]}).start() as d:
        d.notify = notify_socket[1]
        d.socket = str(workdir / "control.sock")
        d.while_starting = answers_while_starting(d)
        d.wait_ready()
        yield d


# Every endpoint but ours, before the first engine is up (vLLM's app does not exist yet).
STARTING_REQUESTS = [
    ("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/version", None), ("GET", "/ping", None),
    ("GET", "/openapi.json", None), ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/tokenize", {"prompt": "x"}), ("GET", "/no-such-endpoint", None),
]


def answers_while_starting(d: Daemon, timeout_s: float = 120) -> list[tuple[str, str, httpx.Response]]:
    """The answers to ``STARTING_REQUESTS`` (and ``/readyz``) while the daemon is STARTING:
    the first round that ``/livez`` brackets with state "starting" before and after (the
    first engine build takes tens of seconds; the round, milliseconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            before = d.get("/livez", timeout=2).json()["state"]
        except httpx.HTTPError:
            time.sleep(0.1)
            continue
        if before != "starting":
            break
        got = [(m, p, d.request(m, p, json=b, headers=AUTH, timeout=10)) for m, p, b in STARTING_REQUESTS]
        got.append(("GET", "/readyz", d.get("/readyz")))
        if d.get("/livez").json()["state"] == "starting":
            return got
    return []


def test_every_other_endpoint_is_503_with_retry_after_while_starting(daemon):
    """Until the first engine is up every endpoint but ``/livez``, ``/readyz`` and ``/metrics``
    answers 503 (``/readyz`` too, being not ready), each with ``Retry-After``."""
    got = daemon.while_starting
    assert got, "no round of requests while the daemon was STARTING (the HTTP server came up too late?)"
    wrong = [(m, p, r.status_code, r.headers.get("retry-after"), r.text[:200]) for m, p, r in got
             if r.status_code != 503 or not r.headers.get("retry-after", "").isdigit()]
    assert not wrong, wrong
    for m, p, r in got[:-1]:
        assert r.json()["error"]["code"] == 503 and "starting" in r.json()["error"]["message"], (p, r.text)


def ctl(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "vllm-supervisor"), "ctl", "--socket", daemon.socket, *args],
                          capture_output=True, text=True, timeout=120)


def status(daemon) -> dict:
    out = ctl(daemon, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["status"]


# --- security ----------------------------------------------------------------------------


def test_api_key_is_required_on_v1_only(daemon):
    assert daemon.get("/v1/models").status_code == 401
    r = daemon.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}  # vLLM's own answer
    assert daemon.post("/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert daemon.get("/v1/models", headers=AUTH).status_code == 200
    assert daemon.get("/livez").status_code == 200 and daemon.get("/readyz").status_code == 200
    assert daemon.get("/metrics").status_code == 200 and daemon.get("/health").status_code == 200


def test_oversize_and_malformed_bodies_then_still_serving(daemon):
    big = json.dumps({"prompt": "x" * 100_000, "max_tokens": 1})
    assert daemon.post("/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"}).status_code == 413
    assert daemon.post("/v1/completions", content=b"{", headers=AUTH).status_code == 400
    assert daemon.post("/v1/chat/completions", content=b"null", headers=AUTH).status_code == 400
    c = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0)
    assert c.completions.create(model="demo-tiny-llama", prompt="still here", max_tokens=3).usage.completion_tokens >= 1


# --- metrics -----------------------------------------------------------------------------

SERIES = [
    "vllm_supervisor_state", "vllm_supervisor_engine_generation", "vllm_supervisor_worker_up",
    "vllm_supervisor_worker_deaths_total", "vllm_supervisor_restarts_total",
    "vllm_supervisor_recovery_duration_seconds_bucket", "vllm_supervisor_recovery_phase_duration_seconds_bucket",
    "vllm_supervisor_requests_total", "vllm_supervisor_requests_in_flight", "vllm_supervisor_admission_queue_depth",
    "vllm_supervisor_time_to_first_token_seconds_bucket", "vllm_supervisor_inter_token_latency_seconds_bucket",
    "vllm_supervisor_request_duration_seconds_bucket", "vllm_supervisor_probe_duration_seconds_bucket",
    "vllm_supervisor_probe_last_success_timestamp_seconds",
]


def test_metrics_present_and_valid_for_promtool(daemon, tmp_path):
    """``/metrics`` is ``vllm serve``'s (``vllm:*``, process) plus ours; ``/metrics/supervisor``
    is ours alone and clean for promtool (vLLM's ``:`` names are not)."""
    text = daemon.get("/metrics/supervisor").text
    for name in SERIES:
        assert re.search(rf"^{name}[{{ ]", text, re.M), name
    assert 'vllm_supervisor_state{state="ready"} 1.0' in text
    for phase in ("detect", "drain", "teardown", "placement_group", "engine_start"):
        assert f'phase="{phase}"' in text
    assert not re.search(r"^vllm:", text, re.M)
    both = daemon.get("/metrics").text
    assert re.search(r"^vllm:generation_tokens_total", both, re.M), "vLLM's own series are missing"
    assert re.search(r"^process_resident_memory_bytes", both, re.M)
    assert all(re.search(rf"^{name}[{{ ]", both, re.M) for name in SERIES)
    families = re.findall(r"^# TYPE (\S+)", both, re.M)
    assert len(families) == len(set(families)), "a metric family appears twice"
    ensure_prometheus()
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_real_prometheus_scrapes_the_daemon(daemon, tmp_path):
    ensure_prometheus()
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: vllm-supervisor\n    static_configs: [{{targets: ['127.0.0.1:{daemon.port}']}}]\n"
    )
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"

    def query(expr: str) -> list | None:
        """One instant query; None until Prometheus answers 200 (it says 503 while starting)."""
        try:
            r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5)
        except httpx.HTTPError:
            return None
        return r.json()["data"]["result"] if r.status_code == 200 else None

    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # Prometheus itself ready first
            try:
                if httpx.get(f"{base}/-/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        up = state = engine = None
        while time.monotonic() < deadline:
            up = query('up{job="vllm-supervisor"}')
            state = query('vllm_supervisor_state{state="ready"}')
            engine = query('vllm:num_requests_running{job="vllm-supervisor"}')  # vLLM's series, same scrape
            if up and state and engine:
                break
            time.sleep(1)
        assert up and up[0]["value"][1] == "1", up
        assert state and state[0]["value"][1] == "1", state
        assert engine, engine
    finally:
        prom.terminate()
        prom.wait(30)


# --- private sockets -------------------------------------------------------------------


def _listening_unix_sockets(pid: int) -> list[str]:
    """The paths of the named Unix sockets that ``pid`` listens on (``/proc/net/unix``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    paths = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 8 and cols[6] in inodes and int(cols[3], 16) & 0x10000 and cols[7].startswith("/"):
            paths.append(cols[7])
    return paths


def test_fork_server_and_ray_agent_sockets_are_private(daemon):
    """The engine-core fork server's and the Ray agent's Unix sockets (the daemon's own
    processes, found by pid) are in 0700 directories of the daemon's user, and the agent's
    manager refuses a client without its per-start authkey (HMAC challenge)."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    deadline = time.monotonic() + 180
    while not (s := status(daemon))["standby"]["forkserver_pid"]:  # the standby's fork server is up
        assert time.monotonic() < deadline, s["standby"]  # (its workers need not be)
        time.sleep(1.0)
    fork_server, agent = s["standby"]["forkserver_pid"], s["ray"]["agent_pid"]
    assert fork_server and agent, s
    found = {}
    for name, pid in (("fork server", fork_server), ("ray agent", agent)):
        paths = [p for p in _listening_unix_sockets(pid) if "/pymp-" in p]
        assert paths, (name, pid, _listening_unix_sockets(pid))
        for path in paths:
            folder = os.stat(os.path.dirname(path))
            assert (oct(folder.st_mode & 0o777), folder.st_uid) == ("0o700", os.getuid()), (name, path)
        found[name] = paths
    for key in (os.urandom(32), b""):
        for path in found["ray agent"]:
            with pytest.raises(AuthenticationError):
                Client(path, authkey=key).close()


# --- control CLI -------------------------------------------------------------------------


def test_ctl_status_table_and_json(daemon):
    out = ctl(daemon, "status")
    assert out.returncode == 0, out.stderr
    assert "state        ready" in out.stdout and "rank" in out.stdout
    s = status(daemon)
    assert s["state"] == "ready" and len(s["workers"]) == 1
    w = s["workers"][0]
    assert w["rank"] == 0 and w["pid"] > 0 and w["node_id"] and f"-g{s['generation']}" in w["name"]
    assert oct(os.stat(daemon.socket).st_mode & 0o777) == "0o600"


def test_ctl_rejects_bad_commands(daemon):
    assert ctl(daemon, "bogus").returncode != 0
    bad = ctl(daemon, "kill-worker", "7")
    assert bad.returncode != 0 and "out of range" in bad.stderr
    assert ctl(daemon, "resume").returncode != 0  # nothing to resume
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"ipc://{daemon.socket}")
    sock.send(b"\x80\x04pickle?")
    assert json.loads(sock.recv()) == {"ok": False, "error": "request is not JSON"}
    sock.close(0)


def test_ctl_drain_then_resume(daemon):
    assert ctl(daemon, "drain").returncode == 0
    r = daemon.get("/readyz")
    assert r.status_code == 503 and r.json()["state"] == "draining"
    assert r.headers.get("retry-after", "").isdigit(), r.headers
    health = daemon.get("/health")  # no engine admits while draining (docs/operating.md: /health)
    assert health.status_code == 503 and health.headers.get("retry-after", "").isdigit(), (health.status_code, health.headers)
    c = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    result = {}

    import threading

    t = threading.Thread(target=lambda: result.update(out=c.completions.create(model="demo-tiny-llama", prompt="queued", max_tokens=4)))
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "a new request must wait while draining"
    assert ctl(daemon, "resume").returncode == 0
    t.join(60)
    assert result["out"].usage.completion_tokens == 4
    assert daemon.get("/readyz").status_code == 200


LONG = 600  # tokens: the requests outlive the 0.5 s drain


def _reference(daemon) -> dict:
    records, _ = asyncio.run(run_with_fault(daemon.base_url, len(PROMPTS), LONG, api_key=KEY))
    return as_reference(records)


def metric(daemon, name: str, **labels: str) -> float:
    """The sum of the daemon's /metrics samples of ``name`` that carry these labels (0 when
    absent; a series of each replica is summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(daemon.get("/metrics").text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_ctl_restart_under_load_loses_nothing(daemon):
    ref = _reference(daemon)
    before = status(daemon)["generation"]
    continued = metric(daemon, "vllm_supervisor_requests_total", outcome="continued")
    records, _ = asyncio.run(run_with_fault(daemon.base_url, 6, LONG, lambda: ctl(daemon, "restart"), api_key=KEY))
    summary = compare(records, ref)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, summary
    s = daemon.wait_generation(before + 1)
    assert s["restarts"].get("operator") == 1
    # The drain ended with requests running: they were continued on the new engine, not
    # finished on the old one; and the series count this recovery (not just exist).
    assert metric(daemon, "vllm_supervisor_requests_total", outcome="continued") - continued == 6
    assert metric(daemon, "vllm_supervisor_restarts_total", reason="operator") == 1
    for phase in ("drain", "teardown", "placement_group", "engine_start"):
        assert metric(daemon, "vllm_supervisor_recovery_phase_duration_seconds_count", phase=phase) >= 1, phase
    assert metric(daemon, "vllm_supervisor_recovery_duration_seconds_count") >= 1
    assert metric(daemon, "vllm_supervisor_engine_generation") == before + 1


def test_ctl_kill_worker_drill_recovers(daemon):
    """… and ``/health`` (vLLM's) is 503, with ``Retry-After``, while the daemon recovers."""
    import threading

    before = status(daemon)["generation"]
    polls: list[tuple[str, int, str | None, str]] = []  # (state before, /health status, Retry-After, state after)
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                state = daemon.get("/livez", timeout=5).json()["state"]
                r = daemon.get("/health", timeout=5)
                polls.append((state, r.status_code, r.headers.get("retry-after"), daemon.get("/livez", timeout=5).json()["state"]))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        out = ctl(daemon, "kill-worker", "0")
        assert out.returncode == 0, out.stderr
        s = daemon.wait_generation(before + 1)
    finally:
        done.set()
        poller.join(30)
    assert s["restarts"].get("worker_death", 0) >= 1
    recovering = [p for p in polls if p[0] == p[3] == "recovering"]
    assert recovering, polls
    assert all(code == 503 and (retry or "").isdigit() for _, code, retry, _ in recovering), recovering
    assert daemon.get("/health").status_code == 200


# --- reload ------------------------------------------------------------------------------


def test_sighup_with_invalid_config_keeps_serving(daemon):
    good = daemon.config_path.read_text()
    daemon.config_path.write_text(good.replace("max_model_len = 1024", "max_model_len = -5"))
    try:
        before = status(daemon)
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while not status(daemon)["config_error"] and time.monotonic() < deadline:
            time.sleep(0.2)
        s = status(daemon)
        assert "engine.max_model_len" in s["config_error"]
        assert s["state"] == "ready" and s["generation"] == before["generation"]
        assert "config error" in ctl(daemon, "status").stdout
    finally:
        daemon.config_path.write_text(good)


def test_sighup_engine_change_rebuilds_behind_a_drain(daemon):
    before = status(daemon)["generation"]
    daemon.config_path.write_text(daemon.config_path.read_text().replace("max_model_len = 1024", "max_model_len = 900"))

    def reload():
        daemon.proc.send_signal(signal.SIGHUP)

    continued = metric(daemon, "vllm_supervisor_requests_total", outcome="continued")
    records, _ = asyncio.run(run_with_fault(daemon.base_url, 4, LONG, reload, api_key=KEY))
    assert all(r.outcome == "ok" and r.usage_completion_tokens == LONG for r in records), [r.error for r in records]
    s = daemon.wait_generation(before + 1)
    assert metric(daemon, "vllm_supervisor_requests_total", outcome="continued") - continued == 4
    # systemd saw the reload: RELOADING=1 with MONOTONIC_USEC, then READY=1 when the new engine serves.
    messages = list(daemon.notify)
    reloading = [i for i, m in enumerate(messages) if m.startswith("RELOADING=1")]
    assert len(reloading) == 1 and "MONOTONIC_USEC=" in messages[reloading[0]], messages
    assert any(m.startswith("READY=1") and f"generation {before + 1}" in m for m in messages[reloading[0]:]), messages
    assert s["config_error"] == "" and s["restarts"].get("reload") == 1
    models = daemon.get("/v1/models", headers=AUTH).json()
    assert models["data"][0]["max_model_len"] == 900


def test_sighup_supervisor_and_api_key_changes_apply_at_once(daemon):
    """No rebuild for supervisor settings or the API key: the key is read per request, so a
    rotated key works (and the old one stops working) as soon as the reload is handled."""
    before = status(daemon)
    good = daemon.config_path.read_text()
    daemon.config_path.write_text(good.replace(f'api_key = "{KEY}"', 'api_key = "rotated-key"'))
    try:
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while daemon.get("/v1/models", headers={"authorization": "Bearer rotated-key"}).status_code != 200:
            assert time.monotonic() < deadline, daemon.tail()
            time.sleep(0.2)
        assert daemon.get("/v1/models", headers=AUTH).status_code == 401
        s = status(daemon)
        assert s["generation"] == before["generation"] and s["restarts"] == before["restarts"] and s["state"] == "ready"
    finally:
        daemon.config_path.write_text(good)
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while daemon.get("/v1/models", headers=AUTH).status_code != 200:
            assert time.monotonic() < deadline, daemon.tail()
            time.sleep(0.2)


def test_sigterm_after_operations_leaves_nothing(daemon):
    code, _ = daemon.stop(signal.SIGTERM)
    assert code == 0, daemon.tail()
    daemon.assert_nothing_left()
    assert not Path(daemon.socket).exists()


def test_the_log_holds_no_api_key_and_no_prompt_text(daemon):
    """Everything the daemon, vLLM and Ray printed at the default (info) level through this
    module's requests, restarts, kills and reloads: neither key nor a prompt is in it."""
    text = daemon.log_path.read_text(errors="replace")
    assert "building engine" in text and "state transition" in text  # the log is the daemon's
    assert KEY not in text and "rotated-key" not in text
    leaked = [p for p in PROMPTS if p in text]
    assert not leaked, leaked


# --- systemd -----------------------------------------------------------------------------


@pytest.mark.parametrize("unit", ["vllm-supervisor.service", "ray-head.service"])
def test_systemd_units_verify(unit, tmp_path):
    text = (ROOT / "systemd" / unit).read_text().replace("/opt/vllm-supervisor/.venv/bin/", f"{BIN}/")
    path = tmp_path / unit
    path.write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Type=notify" in text or unit == "ray-head.service"


def test_systemd_security_exposure(tmp_path):
    text = (ROOT / "systemd" / "vllm-supervisor.service").read_text().replace("/opt/vllm-supervisor/.venv/bin/", f"{BIN}/")
    path = tmp_path / "vllm-supervisor.service"
    path.write_text(text)
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(path)], capture_output=True, text=True, timeout=60)
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout).group(1))
    print(f"\nsystemd-analyze security exposure: {score}")
    assert score <= 3.0, out.stdout
    for directive in ("NotifyAccess=main", "WatchdogSec=", "Restart=on-failure", "KillMode=mixed", "ExecReload=",
                      "DeviceAllow=char-nvidia-frontend rw", "TimeoutStopSec="):
        assert directive in text, directive
