"""``vllm-supervisor serve`` = ``vllm serve``'s flags + a "supervision" group.

This module stays importable without vLLM: the supervision flags are parsed (and a bad
value exits 78) before vLLM's own parser is even imported.

* The supervision flags are made from the typed settings: ``supervisor.*`` as ``--<key>``
  (``--max-restarts``, ``--drain-timeout-s``, …), ``ray.*`` as ``--ray-<key>``; the two
  whose names vLLM already uses get a ``--supervisor-`` prefix. Their precedence stays
  defaults < TOML (``--supervisor-config``) < ``VLLM_SUPERVISOR_*`` env < flags.
* vLLM's flags keep their meaning. The TOML's ``[engine]`` and ``[server]`` keys that
  mirror a vLLM flag become that flag's default (a flag on the command line wins).
* With no model anywhere, the built-in demo model is served with small defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from config.settings import (
    EngineSettings, RaySettings, ServerSettings, Settings, SupervisorSettings, _parse_scalar, load_settings,
    parse_assignment,
)

_RENAMED = {"supervisor.log_level": "--supervisor-log-level", "supervisor.log_format": "--supervisor-log-format"}


def supervision_flags() -> dict[str, str]:
    """flag -> dotted settings key."""
    flags = {}
    for key in SupervisorSettings.model_fields:
        dotted = f"supervisor.{key}"
        flags[_RENAMED.get(dotted, "--" + key.replace("_", "-"))] = dotted
    for key in RaySettings.model_fields:
        flags["--ray-" + key.replace("_", "-")] = f"ray.{key}"
    flags["--max-body-bytes"] = "server.max_body_bytes"
    flags["--cpu-kv-cache-space-gib"] = "engine.kv_cache_space_gib"
    return flags


def add_supervision_group(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "supervision", "vllm-supervisor's own options (also in --supervisor-config TOML and VLLM_SUPERVISOR_* env)")
    group.add_argument("--supervisor-config", metavar="TOML",
                       help="supervisor config file (vLLM's --config YAML stays vLLM's)")
    group.add_argument("--set", dest="sv_assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="set any supervisor config key (repeatable)")
    models = {"supervisor": SupervisorSettings, "ray": RaySettings, "server": ServerSettings, "engine": EngineSettings}
    for flag, dotted in supervision_flags().items():
        section, key = dotted.split(".")
        field = models[section].model_fields[key]
        default = "" if field.default_factory else f" [default: {field.default!s}]"
        text = f": {field.description}" if field.description else ""
        # SUPPRESS: an absent flag leaves no attribute (the TOML/env value stands), and vLLM's
        # help formatter prints no misleading "(default: None)".
        group.add_argument(flag, dest="sv__" + dotted.replace(".", "__"), default=argparse.SUPPRESS, metavar="V",
                           help=f"{dotted}{text}{default}")


def supervision_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in vars(ns).items():
        if name.startswith("sv__") and value is not None:
            out[name[4:].replace("__", ".")] = _parse_scalar(value)
    for text in getattr(ns, "sv_assignments", []) or []:
        dotted, value = parse_assignment(text)
        out[dotted] = value
    return out


def load_supervision(argv: list[str]) -> Settings:
    """The supervision settings from argv (+ TOML + env), vLLM's flags ignored; raises
    ``ConfigError``."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_supervision_group(pre)
    ns, _vllm_flags = pre.parse_known_args(argv)
    return load_settings(getattr(ns, "supervisor_config", None), supervision_overrides(ns))


# vLLM flag dest -> the TOML [engine]/[server] key that gives its default
_MIRRORED = {
    "model": "engine.model",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "pipeline_parallel_size": "engine.pipeline_parallel_size",
    "max_model_len": "engine.max_model_len",
    "dtype": "engine.dtype",
    "enforce_eager": "engine.enforce_eager",
    "seed": "engine.seed",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "host": "server.host",
    "port": "server.port",
}

# Served when no model is named anywhere: small, eager, float32 (greedy output must not
# depend on batch layout), 256 tokens of context.
DEMO_DEFAULTS = {"max_model_len": 256, "enforce_eager": True, "dtype": "float32", "seed": 0}


def vllm_defaults(settings: Settings, demo: bool) -> dict[str, Any]:
    """Defaults for vLLM's parser from the TOML (only keys the TOML or env set), the
    supervisor's safe host default, and in demo mode the demo defaults."""
    out: dict[str, Any] = dict(DEMO_DEFAULTS) if demo else {}
    out["host"] = settings.server.host  # 127.0.0.1 unless configured: no accidental exposure
    out["port"] = settings.server.port
    if settings.server.api_key:
        out["api_key"] = [settings.server.api_key]
    e = settings.engine
    for dest, dotted in _MIRRORED.items():
        section, key = dotted.split(".")
        if section == "engine" and key in e.model_fields_set:
            out[dest] = getattr(e, key)
    if "served_model_name" in e.model_fields_set and e.served_model_name:
        out["served_model_name"] = [e.served_model_name]
    if "executor" in e.model_fields_set:
        out["distributed_executor_backend"] = e.executor
    out.update(e.extra_args)
    if out.get("model") == "":
        del out["model"]
    return out
