"""The standby engine-core process: a fork server with vLLM already imported.

vLLM starts the engine core with ``spawn`` wherever ``fork`` is unsafe (always on the CPU
platform, which sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``): a fresh interpreter that
imports vLLM again, about 6 s of every engine start on a 2-core machine. Python's
``forkserver`` start method keeps one process that imported the modules once and forks a
child per ``Process.start()``; the child unpickles its target and arguments exactly as a
spawned one would, so vLLM's engine core runs unchanged.

Two differences from ``spawn`` are closed here:

* Environment: a forkserver child inherits the fork server's environment, not the
  caller's at ``start()``. ``EnvReplayProcess`` carries the caller's environment along and
  installs it in the child before the target runs, as a spawned child would have it.
* Scope: only vLLM's engine-core launcher (``vllm.v1.engine.utils``) is pointed at the fork
  server, and only while one engine is built (``engine_core_start_method``). The engine
  core's own children (the ``mp`` executor's workers) keep vLLM's method.

The fork server is a child of the daemon: it exits when the daemon does (Python closes its
"alive" pipe), also on ``kill -9``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import threading
import time
from typing import Iterator

# What the engine core imports before it runs: vLLM's engine core and our executors.
PRELOAD = ["vllm.v1.engine.core", "executor.ray_v2", "executor.mp"]


class EnvReplayProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver child that runs with the environment its parent had at ``start()``."""

    def start(self) -> None:
        self._parent_env = dict(os.environ)
        super().start()

    def run(self) -> None:
        env = getattr(self, "_parent_env", None)
        if env is not None:
            # setproctitle maps the process title over argv and the original environ block;
            # once the environment is replaced it can no longer find that block, so it is
            # set up first (vLLM names its processes "VLLM::EngineCore" with it).
            try:
                import setproctitle

                setproctitle.getproctitle()
            except ImportError:
                pass
            os.environ.clear()
            os.environ.update(env)
        super().run()


class EnvReplayForkServerContext(multiprocessing.context.ForkServerContext):
    Process = EnvReplayProcess


_CONTEXT = EnvReplayForkServerContext()
_lock = threading.Lock()


def _noop() -> None:
    pass


def start(preload: list[str] | None = None) -> float:
    """Start the fork server (if it is not running) and wait until its imports are done;
    returns the seconds that took. Blocking: call it from a thread."""
    started = time.monotonic()
    with _lock:
        _CONTEXT.set_forkserver_preload(list(preload or PRELOAD))
        # The server imports its preload list before it answers: one no-op child proves it.
        probe = _CONTEXT.Process(target=_noop, name="vllm-supervisor-forkserver-probe", daemon=True)
        probe.start()
        probe.join()
        if probe.exitcode != 0:
            raise RuntimeError(f"fork server probe exited with {probe.exitcode}")
    return time.monotonic() - started


def pid() -> int | None:
    """The fork server's pid while it runs, else None."""
    server = multiprocessing.forkserver._forkserver
    p = getattr(server, "_forkserver_pid", None)
    if p is None:
        return None
    try:
        done, _ = os.waitpid(p, os.WNOHANG)
    except ChildProcessError:
        return None
    return None if done else p


def stop() -> None:
    """Stop the fork server (children already forked keep running)."""
    with _lock:
        stop_unlocked = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
        if stop_unlocked is not None:
            stop_unlocked()


@contextlib.contextmanager
def engine_core_start_method(use_forkserver: bool) -> Iterator[None]:
    """While building one engine: vLLM's engine-core launcher forks from the fork server
    instead of spawning. A no-op when ``use_forkserver`` is false."""
    if not use_forkserver:
        yield
        return
    import vllm.v1.engine.utils as engine_utils

    original = engine_utils.get_mp_context
    engine_utils.get_mp_context = lambda: _CONTEXT
    try:
        yield
    finally:
        engine_utils.get_mp_context = original
