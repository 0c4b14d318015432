"""The engine core's fork server listens on a socket file in this process's ``multiprocessing``
directory. Python unlinks it only in its own stop; a server that died (its engine core's
failure took it, or it was killed) and is replaced by the next ``start()`` left the file, one
dead socket per replacement until the daemon exited (found by the recovery tests' check for
dead sockets). A real fork server, with a light preload."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
import time

import pytest

from executor import forkserver
from executor.procfs import bound_unix_sockets


def address() -> str | None:
    return multiprocessing.forkserver._forkserver._forkserver_address


def bound(path: str) -> bool:
    """Read from ``/proc``: a connection would have the server read a fork request."""
    return path in bound_unix_sockets()


def kill_server() -> str:
    """Kill the running fork server; its socket file, left as Python leaves it."""
    first, server = address(), forkserver.pid()
    assert first and os.path.exists(first) and server
    os.kill(server, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while forkserver.pid() is not None:  # dead (a zombie until a replacement reaps it)
        assert time.monotonic() < deadline, "the killed fork server still runs"
        time.sleep(0.05)
    assert os.path.exists(first) and not bound(first)
    return first


def replace_by_start() -> None:
    forkserver.start(["json"])


def replace_by_a_build() -> None:
    """An engine build's own fork (the server died after the standby's claim said it was
    alive), not ``start()``."""
    with forkserver.engine_core_start_method(use_forkserver=True):
        import vllm.v1.engine.utils as engine_utils

        child = engine_utils.get_mp_context().Process(target=forkserver._noop, daemon=True)
        child.start()
        child.join(30)
    assert child.exitcode == 0


@pytest.mark.parametrize("replace", [replace_by_start, replace_by_a_build], ids=["start", "a build's fork"])
def test_a_dead_fork_servers_socket_is_removed_when_it_is_replaced(replace):
    forkserver.start(["json"])
    try:
        first = kill_server()
        replace()
        second = address()
        assert second != first and bound(second)
        assert not os.path.exists(first), "the dead server's socket file was left"
    finally:
        forkserver.stop()
    assert not os.path.exists(second)


def test_a_server_started_in_a_fork_server_child_leaves_the_parents_socket(tmp_path):
    """A process forked by the fork server (an engine core) inherits the server's address but
    not its pid; a fork server it starts of its own (the ``mp`` executor's workers under
    ``VLLM_WORKER_MULTIPROC_METHOD=forkserver``) must not remove the daemon's live socket."""
    server = multiprocessing.forkserver._forkserver
    parents = tmp_path / "listener-parent"
    parents.write_text("")  # stands for the daemon's live socket
    server._forkserver_address, server._forkserver_pid = str(parents), None  # as a child of the server has them
    try:
        forkserver.start(["json"])
        assert address() != str(parents) and bound(address())
        assert parents.exists(), "the parent's socket was removed by a child's own fork server"
    finally:
        forkserver.stop()
