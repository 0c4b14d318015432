"""Typed settings (pydantic) for vllm-supervisor. Importable without Ray or vLLM."""

from config.settings import (
    EXIT_CONFIG,
    ConfigError,
    EngineSettings,
    RaySettings,
    ServerSettings,
    Settings,
    SupervisorSettings,
    load_settings,
    parse_assignment,
)

__all__ = [
    "EXIT_CONFIG",
    "ConfigError",
    "EngineSettings",
    "RaySettings",
    "ServerSettings",
    "Settings",
    "SupervisorSettings",
    "load_settings",
    "parse_assignment",
]
