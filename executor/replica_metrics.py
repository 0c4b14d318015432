"""vLLM's own Prometheus metrics (``vllm:*``) for several replicas in one daemon, as
``vllm serve --data-parallel-size N`` shows them: one set of metrics, one ``engine`` label
value per replica.

vLLM registers its metrics once per ``AsyncLLM`` (``PrometheusStatLogger``), and every
registration first removes the ``vllm:*`` collectors already registered
(``unregister_vllm_metrics``). With replicas, ``/metrics`` therefore showed the replica built
last and nothing of the others, and a rebuilt replica started every counter again from 0.

Here the daemon holds one ``PrometheusStatLogger`` for engine indexes 0 … N-1, made when the
first engine is built, and each replica's engine gets a stand-in (``ReplicaMetrics.factory``):
vLLM's ``StatLoggerManager`` sees a Prometheus logger among the custom ones and makes no
default one of its own, and the stand-in forwards each engine step's stats to the shared
logger under the replica's index. A replica rebuilt after a failure goes on counting where it
stopped. vLLM's plugin interface for stat loggers is the hook (``AsyncLLM(stat_loggers=…)``).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.v1.metrics.loggers import PrometheusStatLogger


class ReplicaMetrics:
    """The shared ``vllm:*`` metrics of ``replicas`` engines."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.logger: PrometheusStatLogger | None = None
        self._initialized = False
        self._lock = threading.Lock()

    def _shared(self, vllm_config: Any) -> PrometheusStatLogger:
        with self._lock:
            if self.logger is None:
                self.logger = PrometheusStatLogger(vllm_config, list(range(self.replicas)))
            return self.logger

    def _engine_initialized(self) -> None:
        with self._lock:  # the cache-config info gauge is registered once, for every index
            if self._initialized or self.logger is None:
                return
            self._initialized = True
        self.logger.log_engine_initialized()

    def factory(self, index: int) -> type:
        """The stat-logger class for replica ``index``'s ``AsyncLLM``."""
        owner = self

        class ReplicaPrometheus(PrometheusStatLogger):
            def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None):
                # no super().__init__: it would unregister and register the metrics again
                self.shared = owner._shared(vllm_config)

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                self.shared.record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx=index)

            def record_admission_rejection(self, reason: str) -> None:
                self.shared.record_admission_rejection(reason)

            def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
                self.shared.record_sleep_state(sleep, level)

            def log_engine_initialized(self) -> None:
                owner._engine_initialized()

            def log(self) -> None:
                pass

        ReplicaPrometheus.__name__ = f"ReplicaPrometheus{index}"
        return ReplicaPrometheus
