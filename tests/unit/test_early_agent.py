"""The daemon's first Ray agent is spawned before the command line imports vLLM
(``supervisor.raylink.early_agent``), so that its import of the standby worker's class runs
beside the daemon's own instead of on the first build's path. Ray starts only at ``connect``;
a refused flag kills the agent before the exit; a wrong guess costs only the head start."""

from __future__ import annotations

import os

import pytest

from config import load_settings
from config.exitcodes import EXIT_CONFIG
from config.serve_args import load_supervision
from executor.rayagent import RayService
from supervisor import raylink
from supervisor.raylink import RayLink, early_plan
from tests.unit.cli_inprocess import cli_in_process


@pytest.mark.parametrize("argv, plan", [
    ([], True),  # the defaults: Ray's V2 executor, a warm standby
    (["my-model", "--standby", "none"], False),  # an agent, without vLLM
    (["--distributed-executor-backend", "mp"], None),  # no Ray at all
    (["--distributed-executor-backend=mp"], None),
    (["--distributed_executor_backend", "mp"], None),
    (["--distributed-executor-backend", "ray"], True),
    (["--distributed-executor-backend", "mp", "--distributed-executor-backend", "ray"], True),  # the last, as argparse
    (["--help"], None),
    (["-h"], None),
    (["--help=all"], None),
])
def test_the_guess_from_argv(argv, plan):
    assert early_plan(load_supervision(argv), argv) is plan


def test_the_guess_reads_the_toml_executor_and_the_compiled_graph_switch(monkeypatch):
    assert early_plan(load_settings(None, {"engine": {"executor": "mp"}}), []) is None
    assert early_plan(load_settings(None, {"engine": {"executor": "mp"}}), ["--distributed-executor-backend", "ray"]) is True
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")  # the compiled-graph executor: no standby workers
    assert early_plan(load_settings(None, {}), []) is False


def test_a_bench_can_leave_the_class_import_out_only_with_the_hooks_on(monkeypatch):
    from supervisor.testhooks import ENV, STANDBY_WITHOUT_ENV

    monkeypatch.setenv(STANDBY_WITHOUT_ENV, "starter,idle,preload")
    assert early_plan(load_settings(None, {}), []) is True  # the hooks off: as without the variable
    monkeypatch.setenv(ENV, "1")
    assert early_plan(load_settings(None, {}), []) is False


class FakeAgent:
    made: list["FakeAgent"] = []

    def __init__(self, settings=None, preloading=False, dead=False):
        self.preloading, self.killed, self.started_with, self.dead = preloading, False, None, dead
        self.started_local, self.pid = False, 4242
        FakeAgent.made.append(self)

    def alive(self):
        return not (self.dead or self.killed)

    def start(self, preload=False):
        self.started_with = preload
        return "127.0.0.1:6379"

    def kill(self):
        self.killed = True
        return []


@pytest.fixture
def fake_agents(monkeypatch):
    import executor.rayagent

    FakeAgent.made = []
    monkeypatch.setattr(executor.rayagent, "RayAgent", FakeAgent)
    return FakeAgent.made


def link(early=None, preload=True) -> RayLink:
    ray = RayLink(load_settings(None, {}).ray, daemon_id="vsup1", shape=lambda: (1, 1), early=early)
    ray.preload_worker_class = lambda: preload
    return ray


@pytest.mark.parametrize("early_preloads, wanted", [(True, True), (False, True), (False, False)])
def test_connect_takes_the_early_agent_when_it_fits(fake_agents, early_preloads, wanted):
    early = FakeAgent(preloading=early_preloads)
    ray = link(early, preload=wanted)
    ray.connect()
    assert ray.cluster is early and not early.killed and early.started_with is wanted
    assert len(fake_agents) == 1  # no second agent
    ray.connect()  # a reconnect (the cluster lost) spawns a new one: the early agent was for the first
    assert ray.cluster is fake_agents[1]


def test_an_early_agent_that_imported_vllm_for_nothing_is_killed_and_replaced(fake_agents):
    early = FakeAgent(preloading=True)
    ray = link(early, preload=False)  # e.g. the compiled-graph executor, known only after the parse
    ray.connect()
    assert early.killed and ray.cluster is fake_agents[1] and ray.cluster.started_with is False


def test_an_early_agent_that_died_before_the_connect_is_replaced_not_fatal(fake_agents):
    """It lives ≈ 10 s before the connect (more while a model downloads): a crash in its import
    must not fail the daemon's first start."""
    early = FakeAgent(preloading=True, dead=True)
    ray = link(early, preload=True)
    ray.connect()
    assert early.killed and early.started_with is None  # reaped, never asked to start Ray
    assert ray.cluster is fake_agents[1] and ray.cluster.started_with is True


def test_a_stop_or_the_mp_executor_before_any_connect_kills_the_early_agent(fake_agents):
    early = FakeAgent(preloading=True)
    ray = link(early)
    ray.release()  # a stop before the first connect
    assert early.killed and ray.cluster is None
    early = FakeAgent()
    ray = link(early)
    ray.drop_early()  # the daemon found the mp executor after the parse
    assert early.killed
    ray.connect()
    assert ray.cluster is not early


def test_start_driver_takes_over_how_the_daemons_environment_moved_before_ray_starts(monkeypatch):
    """A private cluster's raylet (and its workers) inherit the agent's environment: an agent
    spawned before the daemon's vLLM import gets what changed since, before ``ray.init``."""
    from executor.rayagent import RayAgent

    monkeypatch.setenv("VSUP_TEST_CHANGED", "at the spawn")
    monkeypatch.setenv("VSUP_TEST_REMOVED", "at the spawn")
    monkeypatch.setenv("VSUP_TEST_SAME", "always")
    agent = RayAgent(load_settings(None, {}).ray)
    agent._spawn_env = dict(os.environ)
    monkeypatch.setenv("VSUP_TEST_CHANGED", "at the connect")
    monkeypatch.delenv("VSUP_TEST_REMOVED")
    monkeypatch.setenv("VSUP_TEST_ADDED", "at the connect")
    changed, removed = agent.env_changes()
    assert changed == {"VSUP_TEST_CHANGED": "at the connect", "VSUP_TEST_ADDED": "at the connect"}
    assert removed == ["VSUP_TEST_REMOVED"]

    # the agent's side, in its own (here: this) process, as it was at the spawn
    monkeypatch.setenv("VSUP_TEST_CHANGED", "at the spawn")
    monkeypatch.setenv("VSUP_TEST_REMOVED", "at the spawn")
    monkeypatch.delenv("VSUP_TEST_ADDED")
    seen: list[tuple] = []
    service = object.__new__(RayService)  # no Ray: ``connect`` stands in
    service.started_local = False
    service.class_import = type("NoImport", (), {"start": lambda self: None})()
    monkeypatch.setattr(service, "connect", lambda: seen.append(tuple(
        os.environ.get(k) for k in ("VSUP_TEST_CHANGED", "VSUP_TEST_REMOVED", "VSUP_TEST_ADDED", "VSUP_TEST_SAME"))) or "addr",
        raising=False)
    assert service.start_driver(False, changed, removed) == ("addr", False)
    assert seen == [("at the connect", None, "at the connect", "always")]
    monkeypatch.setenv("VSUP_TEST_ADDED", "x")  # so that monkeypatch's undo removes what start_driver added


def test_an_agent_half_spawned_is_killed(monkeypatch):
    """A failure after the process started (here: the class import's call) leaves no process;
    ``early_agent`` then says so and returns None (connect spawns one as before)."""
    from executor.rayagent import RayAgent

    pids: list[int] = []
    real_call = RayAgent.call

    def failing_call(self, method, *args):
        pids.append(self.pid)
        if method == "import_worker_class":
            raise RuntimeError("injected")
        return real_call(self, method, *args)

    monkeypatch.setattr(RayAgent, "call", failing_call)
    with cli_in_process():  # the spawn exports Ray's variables, as in the daemon
        assert raylink.early_agent(load_settings(None, {}), []) is None
    assert pids and pids[0] and not os.path.exists(f"/proc/{pids[0]}")


def test_a_refused_flag_kills_the_real_early_agent_before_exit_78(monkeypatch):
    """The real agent's process, spawned by the real command line and importing the worker
    class: the refusal leaves no process of it (and Ray never started)."""
    from supervisor import cli

    spawned, pids = [], []
    real = raylink.early_agent

    trees: list[set] = []

    def spawn(settings, argv):
        agent = real(settings, argv)
        spawned.append(agent)
        pids.append(agent and agent.pid)
        if agent is not None:
            kill = agent.kill
            agent.kill = lambda: trees.append({pid for pid, _ in agent._tree()}) or kill()
        return agent

    monkeypatch.setattr(raylink, "early_agent", spawn)
    with cli_in_process():
        assert cli.main(["serve", "--api-server-count", "2"]) == EXIT_CONFIG
    (agent,), (pid,) = spawned, pids
    assert agent is not None and agent.preloading and pid  # it was spawned, importing vLLM
    assert trees == [{pid}]  # killed once, and nothing under it: no GCS, no raylet (Ray never started)
    assert not os.path.exists(f"/proc/{pid}")  # gone and reaped
    with cli_in_process(), pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert spawned[1:] == [None]  # a help page spawns nothing


def test_a_failed_early_spawn_warns_in_the_daemons_log_format(monkeypatch, capsys):
    """The warning comes before vLLM's parse and before ``run()``: it is still one JSON line on
    stderr (stderr is not a terminal here), as every other line of the daemon, not structlog's
    console default on stdout."""
    import json

    from executor.rayagent import RayAgent
    from supervisor import cli

    def failing_spawn(self, preload):
        raise RuntimeError("injected")

    monkeypatch.setattr(RayAgent, "spawn", failing_spawn)
    # a logger not yet used: structlog caches a logger's configuration at its first line, and
    # other tests of this process may have logged through the module's own before
    from supervisor import logs

    monkeypatch.setattr(raylink, "log", logs.get_logger("vllm_supervisor.raylink"))
    with cli_in_process():  # which puts structlog's configuration back after
        assert cli.main(["serve", "--api-server-count", "2"]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in err.splitlines() if "could not start the Ray agent ahead" in line]
    assert len(lines) == 1 and lines[0]["level"] == "warning" and "injected" in lines[0]["error"], err
    assert "could not start" not in out
