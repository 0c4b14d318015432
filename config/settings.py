"""Typed settings for the daemon.

Sources, lowest precedence first: built-in defaults < TOML file (``--config``) <
``VLLM_SUPERVISOR_<SECTION>__<KEY>`` environment variables < CLI flags.

This module must stay importable without Ray or vLLM: an invalid config has to be
reported (and the process exit 78) before either is imported.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from config.engine_args import reserved_engine_args, vllm_engine_arg_names
from config.exitcodes import EXIT_CONFIG  # noqa: F401 (re-exported)

ENV_PREFIX = "VLLM_SUPERVISOR_"


class ConfigError(Exception):
    """An invalid configuration; ``str()`` is one readable line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class _Section(BaseModel):
    # validate_default: defaults go through the validators too (``data_dir``'s ``~`` is expanded).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)


class EngineSettings(_Section):
    model: str = Field("", description="Model path or name; empty = the built-in demo model.")
    executor: Literal["ray", "mp"] = Field(
        "ray", description="ray: workers are Ray actors (Ray V2 executor); mp: local processes (single node, no Ray)."
    )
    served_model_name: str = Field("", description="Name clients use; defaults to the model's.")
    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)
    max_model_len: int = Field(256, ge=16)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    enforce_eager: bool = True
    seed: int = Field(0, ge=0)
    kv_cache_space_gib: int = Field(
        1, ge=1, description="CPU only: KV cache GiB per worker (VLLM_CPU_KVCACHE_SPACE)."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="Other vLLM EngineArgs, passed through as is."
    )

    @field_validator("extra_args")
    @classmethod
    def _known_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        reserved = reserved_engine_args()
        known = vllm_engine_arg_names()
        for key in value:
            if key in reserved:
                raise ValueError(f"'{key}' is managed by the supervisor; set it elsewhere")
            if known and key not in known:
                raise ValueError(f"'{key}' is not a vLLM engine argument")
        return value


class RaySettings(_Section):
    address: str = Field("", description="Existing cluster ('auto', 'ray://…', 'host:port'); empty = start a local one.")
    namespace: str = Field("vllm-supervisor", min_length=1)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_timeout_s: float = Field(60.0, gt=0)
    num_cpus: int | None = Field(None, ge=1, description="Local cluster only: CPUs Ray may use.")
    object_store_memory_mib: int = Field(256, ge=64, description="Local cluster only.")
    # Loss of the cluster's head (its GCS): the daemon keeps serving /livez, parks its streams,
    # waits for the GCS to listen again and rebuilds; past the deadline it exits 75 for systemd.
    gcs_lost_after_s: float = Field(
        1.0, gt=0, description="The GCS port must refuse (or time out) this long before the cluster counts as lost.")
    reconnect_timeout_s: float = Field(
        120.0, gt=0, description="How long to wait for a lost Ray cluster to come back before exiting 75.")


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str = ""
    max_body_bytes: int = Field(1 << 20, ge=1024)


# A GPU engine's first steps may compile kernels (Triton autotuning, FlashInfer's JIT): tens of
# seconds for one step on a cold cache, the first time each shape is met.
GPU_FIRST_STEPS_TIMEOUT_S = 90.0


class SupervisorSettings(_Section):
    data_dir: Path = Field(Path("~/.local/share/vllm-supervisor"), description="Demo model cache.")
    drain_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: how long in-flight requests may finish.")
    # Restart intensity (Erlang/OTP): more than max_restarts recoveries in restart_window_s => FAILED.
    max_restarts: int = Field(5, ge=0)
    restart_window_s: float = Field(600.0, gt=0)
    restart_backoff_initial_s: float = Field(0.5, ge=0, description="First retry delay after a failed engine build.")
    restart_backoff_max_s: float = Field(15.0, ge=0)
    # Admission while not READY: new requests wait in a bounded queue up to a deadline, then 503.
    admission_queue_size: int = Field(64, ge=0)
    admission_timeout_s: float = Field(120.0, ge=0)
    # Continuation: a parked request is re-submitted at most this many times.
    continuation_limit: int = Field(3, ge=0)
    # A query of death (supervisor.suspects): an input that crashed two engines is refused at
    # admission for quarantine_window_s (the newest quarantine_size inputs are remembered).
    quarantine_window_s: float = Field(600.0, ge=0)
    quarantine_size: int = Field(1024, ge=1)
    recovery_timeout_s: float = Field(600.0, gt=0, description="How long parked requests wait for a new engine.")
    # Hang detection: no engine step for hang_timeout_s while requests are in flight (the engine's
    # own steps: a long chunked prefill is progress), checked twice a second; and a probe every
    # probe_interval_s (the engine's error flag, the Ray cluster), which while the engine is idle
    # sends a one-token canary every canary_interval_s; a canary slower than probe_timeout_s fails.
    probe_interval_s: float = Field(2.0, gt=0)
    canary_interval_s: float = Field(
        30.0, gt=0, description="while idle, a one-token canary this often: a hung idle engine is found before a request finds it")
    probe_timeout_s: float = Field(10.0, gt=0)
    # 4 s: above the worst case for a healthy step's wake-up (a ring reader that lost its
    # notification re-reads the ring after 1 s: executor.canary.bound_lost_wakeup; vLLM's own is
    # 5 s). Raise it where one engine step (a prefill chunk) can take longer than this.
    hang_timeout_s: float = Field(
        4.0, gt=0, description="a busy engine that takes no step for this long is hung (found within about 0.7 s more)")
    # A GPU kernel compiled on its first use (Triton, FlashInfer JIT) runs inside an engine step,
    # for seconds to a minute: a new generation's first steps may take longer than hang_timeout_s.
    hang_first_steps: int = Field(
        64, ge=0, description="a new engine generation's first this many steps are judged by hang_first_steps_timeout_s")
    hang_first_steps_timeout_s: float | None = Field(
        None, gt=0, description="the hang timeout of a generation's first hang_first_steps steps; "
                                "unset: 90 s on a GPU platform (kernels compiled on first use), hang_timeout_s on CPU")
    # A busy engine whose threads wait for a CPU (health.starvation: a host whose cores another
    # engine or job saturates) is starved, not hung: a rebuild would bind the same cores.
    hang_starved_grace_s: float = Field(
        60.0, ge=0, description="a stalled engine whose threads wait for a CPU (starved by the host, not hung) "
                                "is judged hung only after this long starved; 0: at once, like any stall")
    probe_failure_threshold: int = Field(2, ge=1)
    replicas: int = Field(
        1, ge=1, le=64, description="engine replicas, each with its own workers; a failed one's streams move to the others")
    routing: Literal["prefix", "least_streams"] = Field(
        "prefix", description="with replicas: prefix sends a new request to the replica that served its prompt's prefix "
                              "(its prefix cache) unless that one is loaded past a bound; least_streams: the fewest streams")
    routing_slack: int = Field(
        4, ge=0, le=4096, description="with prefix routing: the streams the prefix's replica may run above the least "
                                      "loaded one and still get the request (Ray Serve's imbalanced_threshold); 0: "
                                      "a prefix match only breaks ties")
    standby: Literal["none", "warm"] = Field(
        "warm", description="warm: prepare the next generation's engine-core process and worker actors while this one serves")
    standby_kv: Literal["reserved", "at_adoption"] = Field(
        "reserved", description="CPU: reserved: each warm-standby worker holds its KV cache's memory, zeroed, while it "
                                "waits, so that a recovery does not fault it in (about 0.4 s per GiB here); at_adoption: "
                                "the adopted worker allocates it, as a new one does")
    control_socket: str = Field("", description="Control socket path; empty = $RUNTIME_DIRECTORY/control.sock, else /tmp/vllm-supervisor-<port>.sock")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"

    def first_steps_timeout(self, cpu_platform: bool) -> float:
        """The hang timeout of a new generation's first ``hang_first_steps`` steps."""
        if self.hang_first_steps_timeout_s is not None:
            return max(self.hang_first_steps_timeout_s, self.hang_timeout_s)
        return self.hang_timeout_s if cpu_platform else max(GPU_FIRST_STEPS_TIMEOUT_S, self.hang_timeout_s)

    @field_validator("data_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()


class Settings(_Section):
    engine: EngineSettings = Field(default_factory=EngineSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)

    def to_json(self) -> str:
        """The resolved settings, the API key redacted (``check-config`` prints this)."""
        data = self.model_dump(mode="json")
        if data["server"]["api_key"]:
            data["server"]["api_key"] = "<redacted>"
        return json.dumps(data, indent=2, sort_keys=True)


# ---------------------------------------------------------------------------
# Loading


def _parse_scalar(text: str) -> Any:
    """An env/CLI value: TOML syntax when it parses (numbers, booleans, inline tables), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = target
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([f"config error: {dotted}: '{part}' is not a section"])
        node = child
    node[leaf] = value


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """``VLLM_SUPERVISOR_ENGINE__MODEL=x`` → ``{"engine": {"model": "x"}}``."""
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_dotted(out, dotted, _parse_scalar(raw))
    return out


def _from_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError([f"config error: --config {path}: file not found"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"config error: {path}: not valid TOML: {exc}"]) from None


def _describe(error: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in error["loc"]) or "<root>"
    rule = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"config error: {key}: unknown key"
    value = error.get("input")
    if isinstance(value, (str, int, float, bool)):
        return f"config error: {key} = {json.dumps(value)}: {rule}"
    return f"config error: {key}: {rule}"


def load_settings(
    path: Path | str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Resolve the settings from every source; raise ``ConfigError`` naming each bad key.

    ``overrides`` are CLI values keyed by dotted name (``{"server.port": 9000}``).
    """
    data: dict[str, Any] = {}
    if path:
        data = _from_file(Path(path))
    data = _merge(data, _from_env(os.environ if environ is None else environ))
    cli: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(cli, dotted, value)
    data = _merge(data, cli)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_describe(e) for e in exc.errors()]) from None


def parse_assignment(text: str) -> tuple[str, Any]:
    """``engine.max_model_len=512`` (a ``--set`` flag) → ``("engine.max_model_len", 512)``."""
    dotted, sep, raw = text.partition("=")
    if not sep or not dotted.strip():
        raise ConfigError([f"config error: --set {text!r}: expected SECTION.KEY=VALUE"])
    return dotted.strip(), _parse_scalar(raw.strip())
