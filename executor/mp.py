"""``SupervisedMultiprocExecutor``: vLLM's single-node ``mp`` executor with death events.

The same failure path as the Ray V2 executor: the monitor thread ("MultiprocWorkerMonitor")
sets ``is_failed`` and calls ``shutdown()``, where the dead worker processes are recorded,
then the wrapped failure callback reports them before the engine's own callback runs.
No Ray and no placement group are involved.
"""

from __future__ import annotations

import threading

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from executor.reporting import DeathReporter, Dead


class SupervisedMultiprocExecutor(DeathReporter, MultiprocExecutor):
    def _init_executor(self) -> None:
        self._wire()
        super()._init_executor()

    def shutdown(self) -> None:
        if getattr(self, "is_failed", False) and not getattr(self, "shutting_down", False):
            if threading.current_thread().name == "MultiprocWorkerMonitor":
                self._record_death(self._collect_dead_ranks())
        super().shutdown()

    def _collect_dead_ranks(self) -> list[Dead]:
        dead = []
        for w in getattr(self, "workers", None) or []:
            if not w.proc.is_alive():
                dead.append((w.rank, w.proc.name, "local", f"worker process {w.proc.pid} exited with {w.proc.exitcode}"))
        return dead
