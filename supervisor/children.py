"""What the daemon's child processes inherit from it: as little as possible.

The daemon is a process with threads, an asyncio signal wake-up fd, the HTTP and control
listening sockets and the crash reaper's pipe. A ``fork`` of it carries all of them:

* Python's signal wake-up fd is process-wide and survives ``fork``. A SIGTERM delivered to a
  forked child (teardown sends one to the old engine core) writes its number into the socket
  the daemon's event loop reads, and the daemon takes the child's signal for its own and stops.
* The inherited listening sockets and the reaper's pipe keep the ports and the reaper's
  "daemon alive" signal open after the daemon dies.

vLLM's own default start method is ``fork`` (``VLLM_WORKER_MULTIPROC_METHOD``); the CPU platform
forces ``spawn``, CUDA does not, and ``vllm serve`` sets ``spawn`` in its command-line set-up
(``cli_env_setup``). So does the daemon, before anything imports vLLM (``prefer_spawn``), and the
engine core is never forked from the daemon whatever the variable says
(``executor.forkserver.engine_core_start_method``). For any fork that remains (a library's
``os.fork``), ``forget_signals_in_forks`` makes the child drop the daemon's signal set-up.
"""

from __future__ import annotations

import os
import signal
from typing import MutableMapping

START_METHOD_VAR = "VLLM_WORKER_MULTIPROC_METHOD"
DAEMON_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_registered = False


def prefer_spawn(environ: MutableMapping[str, str] = os.environ) -> str:
    """``spawn`` for vLLM's processes unless the operator chose a method, as ``vllm serve``
    does; returns the method in force. (The operator's ``fork`` still applies inside the
    engine core, to the ``mp`` executor's workers; never to the engine core itself.)"""
    return environ.setdefault(START_METHOD_VAR, "spawn")


def _forget_daemon_signals() -> None:
    """In a forked child: no wake-up fd into the daemon's loop, default dispositions for the
    signals the daemon handles (a child that wants its own installs them, as vLLM's engine
    core does)."""
    try:
        signal.set_wakeup_fd(-1)
        for signum in DAEMON_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
    except (ValueError, OSError):  # not the main thread of the child's interpreter
        pass


def forget_signals_in_forks() -> None:
    """Every ``os.fork`` of this process from now on drops the daemon's signal set-up in the
    child (once per process; Python keeps the hook until exit)."""
    global _registered
    if not _registered:
        os.register_at_fork(after_in_child=_forget_daemon_signals)
        _registered = True
