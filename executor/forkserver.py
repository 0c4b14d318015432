"""The standby engine-core process: a fork server with vLLM already imported.

The daemon starts every engine core with ``spawn`` (``engine_core_start_method``; a fork of the
daemon is never safe, ``supervisor.children`` says why, and vLLM's own default, ``fork``, is
what it would use on CUDA): a fresh interpreter that imports vLLM again, about 6 s of every
engine start on a 2-core machine. Python's
``forkserver`` start method keeps one process that imported the modules once and forks a
child per ``Process.start()``; the child unpickles its target and arguments exactly as a
spawned one would, so vLLM's engine core runs unchanged.

Two differences from ``spawn`` are closed here, and one advantage taken (a child freezes what
the server imported out of the garbage collector's walks, ``EnvReplayProcess.run``):

* Environment: a forkserver child inherits the fork server's environment, not the
  caller's at ``start()``. ``EnvReplayProcess`` carries the caller's environment along and
  installs it in the child before the target runs, as a spawned child would have it.
* Scope: only vLLM's engine-core launcher (``vllm.v1.engine.utils``) is pointed at the fork
  server, and only while one engine is built (``engine_core_start_method``). The engine
  core's own children (the ``mp`` executor's workers) keep vLLM's method.

The fork server is a child of the daemon and the parent of every engine core it forks: it
exits when the daemon and those engine cores have closed its "alive" pipe (on ``kill -9`` of
the daemon too, once its engine core is gone). If it dies, the engine core it forked is seen
as dead by vLLM (its exit status comes through the server): the daemon recovers as from any
engine-core death, and the standby starts a new fork server.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
from typing import Iterator

from executor.procfs import running

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
        # What the fork server imported is frozen out of the collector's walks before vLLM
        # runs (gc.freeze is a list splice, no walk): the engine core's freeze_gc_heap then
        # collects only what its build made, not the ~600,000 imported objects (≈ 0.4 s each
        # full collection on 2 cores).
        gc.freeze()
        super().run()


class EnvReplayForkServerContext(multiprocessing.context.ForkServerContext):
    Process = EnvReplayProcess


_CONTEXT = EnvReplayForkServerContext()


class EngineCoreSpawnProcess(multiprocessing.context.SpawnProcess):
    """A spawned engine core that ends as a fork-server child does: ``os._exit`` once
    multiprocessing's own clean-up has run, without the interpreter's teardown.

    vLLM's engine core returns from its loop with its executor, workers and rings already shut
    down; a spawned child then leaves through ``sys.exit``. Measured in a daemon's stop (py-spy,
    2026-11-27): Ray's exit hook waited 0.5 s "to make sure log messages finish printing" (the
    worker lines this driver relays; its workers are killed by then, so what that wait could
    still catch is their output of the last half second) and disconnected, then the teardown of an
    interpreter with torch and vLLM imported took 1.5 s, about 2.3 s of the engine's 3.1 s
    teardown, which ``vllm serve``'s process manager waits for too. Here Ray's driver is
    disconnected without that wait, the other exit hooks run (logging's flush, vLLM's and
    tracing's hooks), the standard streams are flushed, and the process exits with the code
    ``_bootstrap`` returned: what a fork-server child, which ends with ``os._exit``, skips anyway.
    """

    def _bootstrap(self, parent_sentinel=None):  # runs in the child
        code = super()._bootstrap(parent_sentinel)
        exit_without_teardown(code)


def exit_without_teardown(code: int) -> None:
    """Run the exit hooks (Ray's driver disconnected without its half-second wait), flush the
    standard streams and ``os._exit(code)``. Never returns."""
    try:
        ray_worker = sys.modules.get("ray._private.worker")
        if ray_worker is not None:
            atexit.unregister(ray_worker.shutdown)
            with contextlib.suppress(Exception):
                ray_worker.shutdown()  # not _exiting_interpreter: no 0.5 s sleep
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class EngineCoreSpawnContext(multiprocessing.context.SpawnContext):
    Process = EngineCoreSpawnProcess


_SPAWN = EngineCoreSpawnContext()
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
    """The fork server's pid while it runs, else None. Never reaps it: a dead server stays a
    zombie until ``start()`` (``ensure_running``) reaps and replaces it."""
    p = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return p if p is not None and running(p) else None


def stop(timeout_s: float = 5.0) -> None:
    """Stop the fork server now. Python's own stop waits until every child it forked has
    exited (each inherits its "alive" pipe); this one closes our end, kills the server and
    reaps it, bounded. Call it after the engines it forked are torn down."""
    with _lock:
        server = multiprocessing.forkserver._forkserver
        with server._lock:
            p, fd, address = server._forkserver_pid, server._forkserver_alive_fd, server._forkserver_address
            server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
        if fd is not None:
            os.close(fd)
        _unlink(address)
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
            time.sleep(0.05)


def _unlink_replaced_sockets(server: multiprocessing.forkserver.ForkServer) -> None:
    """Make ``server.ensure_running`` remove a dead server's socket file when it replaces it.

    Python removes a fork server's socket file only in its own stop: ``ensure_running``, which
    replaces a server that died (its engine core's failure took it, or it was killed), forgets
    the old address and leaves the file, one dead socket per replacement until the daemon
    exits. A replacement comes from ``start()``'s probe or from an engine build's own
    ``Process.start()`` (a server that died between the standby's claim and the fork), and it
    may raise once it has forgotten the old one (the new server's spawn failing): the old file
    is removed in each case.
    ``connect_to_new_process`` calls ``self.ensure_running()``, so the instance's attribute is
    what every fork goes through."""
    if getattr(server, "_unlinks_replaced", False):
        return
    original = server.ensure_running

    def ensure_running() -> None:
        # Only a server this process started: a process forked by the fork server (an engine
        # core) inherits the server's address without its pid, and a server of its own must
        # not take the daemon's live socket with it.
        before = server._forkserver_address if server._forkserver_pid is not None else None
        try:
            original()
        finally:
            if before is not None and server._forkserver_address != before:
                _unlink(before)

    server.ensure_running = ensure_running
    server._unlinks_replaced = True


def _unlink(address: object) -> None:
    """Remove a fork server's socket file (not an abstract socket's name, which has none)."""
    if address and isinstance(address, str) and not address.startswith("\0"):
        with contextlib.suppress(OSError):
            os.unlink(address)


_unlink_replaced_sockets(multiprocessing.forkserver._forkserver)


@contextlib.contextmanager
def engine_core_start_method(use_forkserver: bool) -> Iterator[None]:
    """While building one engine: vLLM's engine-core launcher forks from the fork server
    (``use_forkserver``) or spawns (``EngineCoreSpawnProcess``), and never forks the daemon, whatever
    ``VLLM_WORKER_MULTIPROC_METHOD`` says (``supervisor.children``: a forked engine core would
    carry the daemon's signal wake-up fd, listening sockets and the reaper's pipe). The
    variable still applies inside the engine core, to the ``mp`` executor's workers."""
    import vllm.v1.engine.utils as engine_utils

    original = engine_utils.get_mp_context
    context = _CONTEXT if use_forkserver else _SPAWN
    # vLLM's own function still runs for its side effects (it forces and exports the start
    # method its children use, and syncs device visibility variables); its context is not used.
    engine_utils.get_mp_context = lambda: (original(), context)[1]
    try:
        yield
    finally:
        engine_utils.get_mp_context = original
