"""``SupervisedMultiprocExecutor``: vLLM's single-node ``mp`` executor with death events.

The same failure path as the Ray V2 executor: the monitor thread ("MultiprocWorkerMonitor")
sets ``is_failed`` and calls ``shutdown()``, where the dead worker processes are recorded,
then the wrapped failure callback reports them before the engine's own callback runs.
No Ray and no placement group are involved.
"""

from __future__ import annotations

import signal
import threading
import time

from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from executor import canary, resume
from executor.reporting import DeathReporter, Dead

canary.bound_lost_wakeup()  # the engine core's readers, and the workers it forks


class SupervisedMultiprocExecutor(DeathReporter, MultiprocExecutor):
    def _init_executor(self) -> None:
        self._wire()
        resume.install()  # continued requests' grammars start where they stopped
        super()._init_executor()
        self._handles = list(self.workers)  # shutdown() may drop self.workers

    def _late_dead(self) -> list[Dead]:
        """The engine core can shut the executor down (a failed RPC) before the monitor
        thread does, so the monitor records nothing; the processes still tell. Those that
        ``shutdown()`` stopped are among them, so the worker that died by itself is found by
        its exit code (not -SIGTERM), else every exited one is named."""
        deadline = time.monotonic() + 1.0
        while True:
            dead = self._collect_dead_ranks()
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        killed = [d for d in dead if not d[3].endswith(f"exited with {-signal.SIGTERM}")]
        return killed or dead

    def shutdown(self) -> None:
        if getattr(self, "is_failed", False) and not getattr(self, "shutting_down", False):
            if threading.current_thread().name == "MultiprocWorkerMonitor":
                self._record_death(self._collect_dead_ranks())
        super().shutdown()

    def _collect_dead_ranks(self) -> list[Dead]:
        dead = []
        for w in getattr(self, "_handles", None) or getattr(self, "workers", None) or []:
            if not w.proc.is_alive():
                dead.append((w.rank, w.proc.name, "local", f"worker process {w.proc.pid} exited with {w.proc.exitcode}"))
        return dead
