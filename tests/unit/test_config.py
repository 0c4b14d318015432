"""Config precedence (defaults < file < env < CLI) and every validation path."""

import contextlib
import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from config import EXIT_CONFIG, ConfigError, load_settings, parse_assignment
from config.engine_args import vllm_engine_arg_names
from tests.unit.cli_inprocess import cli_in_process


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_need_no_file():
    s = load_settings(environ={})
    assert s.engine.model == ""  # demo model
    assert s.ray.address == ""  # local cluster
    assert s.server.host == "127.0.0.1"


def test_precedence_file_then_env_then_cli(tmp_path):
    path = write(tmp_path, """
        [server]
        port = 9001
        host = "0.0.0.0"
        [engine]
        max_model_len = 512
    """)
    env = {"VLLM_SUPERVISOR_SERVER__PORT": "9002", "VLLM_SUPERVISOR_ENGINE__MAX_MODEL_LEN": "300"}
    s = load_settings(path, {"server.port": 9003}, environ=env)
    assert s.server.port == 9003  # CLI beats env and file
    assert s.engine.max_model_len == 300  # env beats file
    assert s.server.host == "0.0.0.0"  # file beats default


def test_env_values_are_typed():
    s = load_settings(environ={"VLLM_SUPERVISOR_ENGINE__ENFORCE_EAGER": "false",
                               "VLLM_SUPERVISOR_RAY__ADDRESS": "auto",
                               "VLLM_SUPERVISOR_ENGINE__EXTRA_ARGS": "{ max_num_seqs = 8 }"})
    assert s.engine.enforce_eager is False
    assert s.ray.address == "auto"
    assert s.engine.extra_args == {"max_num_seqs": 8}


def test_unrelated_env_is_ignored():
    s = load_settings(environ={"VLLM_SUPERVISOR_CONFIG": "x", "VLLM_CPU_KVCACHE_SPACE": "4"})
    assert s.engine.kv_cache_space_gib == 1


@pytest.mark.parametrize(
    "overrides, key, rule",
    [
        ({"engine.tensor_parallel_size": 0}, "engine.tensor_parallel_size = 0", "greater than or equal to 1"),
        ({"server.port": 70000}, "server.port = 70000", "less than or equal to 65535"),
        ({"server.port": "http"}, 'server.port = "http"', "valid integer"),
        ({"engine.dtype": "int3"}, 'engine.dtype = "int3"', "'auto', 'float32'"),
        ({"ray.placement_strategy": "RANDOM"}, 'ray.placement_strategy = "RANDOM"', "PACK"),
        ({"supervisor.max_restarts": -1}, "supervisor.max_restarts = -1", "greater than or equal to 0"),
        ({"supervisor.restart_window_s": 0}, "supervisor.restart_window_s = 0", "greater than 0"),
        ({"engine.max_model_len": 4}, "engine.max_model_len = 4", "greater than or equal to 16"),
        ({"server.colour": "red"}, "server.colour", "unknown key"),
        ({"nosuchsection.x": 1}, "nosuchsection", "unknown key"),
        ({"engine.extra_args": {"no_such_arg": 1}}, "engine.extra_args", "'no_such_arg' is not a vLLM engine argument"),
        ({"engine.extra_args": {"tensor_parallel_size": 2}}, "engine.extra_args", "managed by the supervisor"),
    ],
)
def test_invalid_values_name_key_value_and_rule(overrides, key, rule):
    with pytest.raises(ConfigError) as info:
        load_settings(None, overrides, environ={})
    (line,) = info.value.problems
    assert line.startswith(f"config error: {key}")
    assert rule in line


def test_every_problem_is_reported_once(tmp_path):
    path = write(tmp_path, """
        [engine]
        tensor_parallel_size = 0
        [server]
        port = -1
    """)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert len(info.value.problems) == 2


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_settings(tmp_path / "nope.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\nmodel = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad, environ={})


def test_bad_env_value_names_the_key():
    with pytest.raises(ConfigError, match="server.port"):
        load_settings(environ={"VLLM_SUPERVISOR_SERVER__PORT": "eighty"})


def test_set_assignment_parsing():
    assert parse_assignment("engine.max_model_len=512") == ("engine.max_model_len", 512)
    assert parse_assignment("ray.address=10.0.0.1:6379") == ("ray.address", "10.0.0.1:6379")
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        parse_assignment("no-equals-sign")


def test_engine_arg_names_come_from_installed_vllm():
    names = vllm_engine_arg_names()
    assert {"max_num_seqs", "swap_space", "enable_prefix_caching"} & names


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True, text=True, timeout=60, env=env)


def test_cli_check_config_prints_resolved(tmp_path):
    path = write(tmp_path, "[server]\nport = 9100\n")
    out = run_cli("check-config", str(path), "--host", "127.0.0.2")
    assert out.returncode == 0, out.stderr
    assert '"port": 9100' in out.stdout and '"host": "127.0.0.2"' in out.stdout


def test_cli_check_config_never_prints_the_api_key(tmp_path):
    path = write(tmp_path, '[server]\napi_key = "sk-very-secret"\n')
    out = run_cli("check-config", str(path))
    assert out.returncode == 0, out.stderr
    assert "sk-very-secret" not in out.stdout and '"api_key": "<redacted>"' in out.stdout


def test_cli_invalid_config_exits_78_before_ray_or_vllm(tmp_path):
    path = write(tmp_path, "[engine]\ntensor_parallel_size = 0\n")
    code = (
        "import sys; from supervisor.cli import main; rc = main(['run', '--config', sys.argv[1]]);"
        "bad = [m for m in ('ray', 'vllm', 'torch') if m in sys.modules]; print('IMPORTED', bad); sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_CONFIG
    assert out.stderr.strip() == "config error: engine.tensor_parallel_size = 0: Input should be greater than or equal to 1"
    assert "IMPORTED []" in out.stdout


# --- `vllm-supervisor serve`: vLLM's parser + the supervision group -------------------------


# The `serve` command lines below run the command line's own ``main`` in this process, where
# vLLM's parser is imported already (a process each cost about 13 s of CPU, 38 s for the five on
# 2 cores). Each refusal spawns the daemon's real early Ray agent and kills it
# (tests/unit/test_early_agent.py checks that it is gone).
SERVE_REFUSALS = [
    (["--tensor-parallel-size", "two"], 2, "invalid int value"),  # vLLM's own argparse answer
    (["--api-server-count", "2"], EXIT_CONFIG, "--api-server-count"),
    (["--distributed-executor-backend", "uni"], EXIT_CONFIG, "supervised backends"),
]
SERVE_ARGVS = [("--help",), ("--help=all",), *(tuple(argv) for argv, _, _ in SERVE_REFUSALS)]


@pytest.fixture(scope="module")
def serve_runs() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    from supervisor.cli import main

    runs = {}
    for argv in SERVE_ARGVS:
        out, err = io.StringIO(), io.StringIO()
        with cli_in_process(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["serve", *argv])
            except SystemExit as exc:  # argparse: a help page, a value it refuses
                code = exc.code
        runs[argv] = subprocess.CompletedProcess(["vllm-supervisor", "serve", *argv], code, out.getvalue(), err.getvalue())
    return runs


def test_serve_help_shows_vllm_flags_and_the_supervision_group(serve_runs):
    """As ``vllm serve --help``: the config groups, ours among them; ``--help=all`` every flag."""
    out = serve_runs[("--help",)]
    assert out.returncode == 0, out.stderr
    assert "ParallelConfig" in out.stdout and "Frontend" in out.stdout and "supervision" in out.stdout
    out = serve_runs[("--help=all",)]
    for flag in ("--tensor-parallel-size", "--tool-call-parser", "--api-key", "--chat-template",  # vLLM's
                 "--max-restarts", "--drain-timeout-s", "--hang-timeout-s", "--ray-address",
                 "--ray-placement-strategy", "--control-socket", "--supervisor-config"):
        assert flag in out.stdout, flag
    assert "supervisor.max_restarts [default: 5]" in " ".join(out.stdout.split())


def test_serve_bad_supervision_value_exits_78_before_vllm_is_imported():
    code = ("import sys; from supervisor.cli import main; rc = main(['serve', 'some/model', '--max-restarts', '-1']);"
            "print('IMPORTED', [m for m in ('ray', 'vllm', 'torch') if m in sys.modules]); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_CONFIG
    assert out.stderr.strip() == "config error: supervisor.max_restarts = -1: Input should be greater than or equal to 0"
    assert "IMPORTED []" in out.stdout


@pytest.mark.parametrize("argv, code, message", SERVE_REFUSALS)
def test_serve_flags_vllm_or_supervision_refuse(serve_runs, argv, code, message):
    out = serve_runs[tuple(argv)]
    assert out.returncode == code, out.stderr[-500:]
    assert message in out.stderr


def test_serve_precedence_flag_over_toml_engine_key_and_demo_defaults(tmp_path):
    from supervisor.cli import parse_serve

    path = write(tmp_path, """
        [engine]
        max_model_len = 512
        extra_args = { max_num_seqs = 8 }
        [supervisor]
        max_restarts = 7
    """)
    settings, ns = parse_serve(["--supervisor-config", str(path), "--max-restarts", "9"])
    assert settings.supervisor.max_restarts == 9  # flag over TOML
    assert ns.model == "" and ns.max_model_len == 512 and ns.max_num_seqs == 8  # TOML [engine] as vLLM defaults
    assert ns.dtype == "float32" and ns.enforce_eager and ns.host == "127.0.0.1"  # the demo model's defaults
    _, ns = parse_serve(["--supervisor-config", str(path), "--max-model-len", "300", "--dtype", "bfloat16"])
    assert ns.max_model_len == 300 and ns.dtype == "bfloat16"  # a vLLM flag beats both
    _, ns = parse_serve(["my/model", "--port", "9001"])
    assert ns.model == "my/model" and ns.max_model_len is None and ns.dtype == "auto"  # vLLM's defaults
    assert ns.distributed_executor_backend == "ray" and ns.port == 9001


def test_serve_data_parallel_on_a_dense_model_is_replicas():
    """``--data-parallel-size N`` (no expert parallelism) = N supervised replicas of DP=1
    engines; what cannot be supervised is refused with the reason."""
    from supervisor.cli import ServeArgsError, parse_serve

    settings, ns = parse_serve(["--data-parallel-size", "2"])
    assert settings.supervisor.replicas == 2 and ns.data_parallel_size == 1
    settings, ns = parse_serve(["--data-parallel-size", "2", "--replicas", "2", "--data-parallel-backend", "ray"])
    assert settings.supervisor.replicas == 2 and ns.data_parallel_size == 1
    for argv, message in ((["--enable-expert-parallel"], "expert-parallel ranks are coupled"),
                          (["--replicas", "3"], "the same setting twice"),
                          (["--data-parallel-address", "10.0.0.1"], "--data-parallel-address: not used"),
                          (["--data-parallel-size-local", "1"], "--data-parallel-size-local 1")):
        with pytest.raises(ServeArgsError, match=message):
            parse_serve(["--data-parallel-size", "2", *argv])
    settings, _ = parse_serve(["--replicas", "3"])
    assert settings.supervisor.replicas == 3  # without data parallelism, replicas as before
