"""Structured logs (structlog): JSON when stderr is not a TTY, every line with state and generation."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import structlog

_context: Callable[[], dict[str, Any]] = lambda: {}


def set_context_provider(provider: Callable[[], dict[str, Any]]) -> None:
    """``provider()`` returns the fields every line carries (state, generation)."""
    global _context
    _context = provider


def _add_daemon_context(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in _context().items():
        event.setdefault(key, value)
    return event


def configure(level: str = "info", fmt: str = "auto") -> None:
    json_out = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if json_out else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_daemon_context,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str = "vllm_supervisor") -> Any:
    return structlog.get_logger(name)
