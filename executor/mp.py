"""``SupervisedMultiprocExecutor``: vLLM's single-node ``mp`` executor with death events.

The same failure path as the Ray V2 executor: the monitor thread ("MultiprocWorkerMonitor")
sets ``is_failed`` and calls ``shutdown()``, where the dead worker processes are recorded,
then the wrapped failure callback reports them before the engine's own callback runs.
No Ray and no placement group are involved.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time

from vllm.v1.executor import multiproc_executor
from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc

from executor import canary, cpu_binding, resume
from executor.reporting import DeathReporter, Dead

canary.bound_lost_wakeup()  # the engine core's readers, and the workers it forks


class SupervisedWorkerProc(canary.CanaryIdle, WorkerProc):
    """vLLM's worker process; after a step that held only the idle canary it waits for the
    next step without spinning (``executor.canary``: else every canary costs the worker a
    second of a core, 3 points of idle CPU with the default 30 s canary)."""


# ``WorkerProc.worker_main`` builds the module's ``WorkerProc``. The executor sets it while it
# starts its workers (a forked worker keeps it); a spawned worker imports this module while its
# arguments are unpickled (they name the executor class), under vLLM's process name for it. Not
# for good in every process: Ray V2's ``RayWorkerProc`` subclasses vLLM's own class.
if multiprocessing.current_process().name.startswith("VllmWorker"):
    multiproc_executor.WorkerProc = SupervisedWorkerProc


class SupervisedMultiprocExecutor(DeathReporter, MultiprocExecutor):
    def _init_executor(self) -> None:
        self._wire()
        resume.install()  # continued requests' grammars start where they stopped
        multiproc_executor.WorkerProc = SupervisedWorkerProc
        try:
            with cpu_binding.replica_slice(self.vllm_config):  # a replica's cores, as a DP rank's
                super()._init_executor()
        finally:
            multiproc_executor.WorkerProc = WorkerProc
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
