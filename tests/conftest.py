"""Fixtures shared by the integration and chaos tiers."""

import contextlib
import socket
import threading

from chaos.harness import RayHead, as_operator  # first: it keeps the user's environment for the daemons

# The test process is the operator of the Ray heads the chaos tests start and the fault injector
# that joins them: it exports the operator's token (Ray reads the mode when it is imported, and
# vLLM imports Ray). The daemons never inherit it: each starts from the user's environment
# (``chaos.harness.USER_ENV``), and one on an operator's cluster is handed the token by its test.
as_operator()

import pytest  # noqa: E402

from chaos import inject  # noqa: E402


@contextlib.contextmanager
def running_ray_head(num_cpus: int = 2):
    """A private Ray head (``ray start --head``), stopped by marker afterwards."""
    head = RayHead(num_cpus=num_cpus).start()
    try:
        yield head
    finally:
        try:
            inject.disconnect()  # the test process may have connected to inject faults
        finally:
            head.stop()


@pytest.fixture(scope="module")
def ray_head():
    """A head per test module."""
    with running_ray_head() as head:
        yield head


@pytest.fixture
def own_ray_head():
    """A head for one test only (one that stops or restarts it)."""
    with running_ray_head() as head:
        yield head


@pytest.fixture(scope="module")
def notify_socket(tmp_path_factory):
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET, read
    continuously (like systemd) by a thread; yields (path, list of messages)."""
    path = str(tmp_path_factory.mktemp("notify") / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    messages: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                messages.append(sock.recv(65536).decode())
            except socket.timeout:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    yield path, messages
    stop.set()
    reader.join(5)
    sock.close()
