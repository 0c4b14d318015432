"""The engine's step clock: when the engine core last finished a step.

vLLM's engine core sends its scheduler stats to the front end after every step it takes
(``Scheduler.update_from_output``: "we must return the stats even if there are no request
outputs this step"), and ``AsyncLLM`` hands them to its stat loggers. Each chunk of a chunked
prefill is one step, so a long prompt keeps the clock moving although no token comes out for a
long time: the probe judges a busy engine's progress by this clock, not by tokens. vLLM's own
plugin interface (``StatLoggerBase``) is the hook; no vLLM internals are touched.

It ticks with ``--disable-log-stats`` too: ``AsyncLLM`` turns its stats back on when a logger
is registered ("enabling logging without default stat loggers"), so the engine core still
sends them and only vLLM's own loggers stay off. ``StepClock.ticking`` stays False only for an
engine that reports no step at all; the probe then falls back to tokens.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase


class StepClock:
    """When the engine last stepped (``time.monotonic()``), and how many steps it reported."""

    def __init__(self) -> None:
        self.last_monotonic = time.monotonic()
        self.steps = 0

    @property
    def ticking(self) -> bool:
        """Whether the engine reported any step (its stats are on)."""
        return self.steps > 0

    def factory(self):
        """A per-engine stat logger factory for ``AsyncLLM(stat_loggers=[...])``."""
        clock = self

        class StepLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:  # one per engine step
                    clock.last_monotonic = time.monotonic()
                    clock.steps += 1

            def log_engine_initialized(self) -> None:
                pass

        return StepLogger
