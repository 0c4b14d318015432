"""sd_notify over a real AF_UNIX datagram socket."""

import socket

from health.notify import SystemdNotifier


def test_messages_reach_the_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(2)
    n = SystemdNotifier(path)
    n.ready("ready (generation 1)")
    n.status("recovering")
    n.watchdog()
    n.reloading()
    n.stopping("bye")
    got = [server.recv(4096).decode() for _ in range(5)]
    assert got[0] == "READY=1\nSTATUS=ready (generation 1)"
    assert got[1] == "STATUS=recovering"
    assert got[2] == "WATCHDOG=1"
    assert got[3].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert got[4] == "STOPPING=1\nSTATUS=bye"


def test_no_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = SystemdNotifier()
    assert not n.enabled
    n.ready("x")  # nothing to send to, nothing raised


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch, tmp_path):
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert SystemdNotifier(str(tmp_path / "s")).watchdog_interval_s == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert SystemdNotifier(str(tmp_path / "s")).watchdog_interval_s is None


def test_a_reader_that_falls_behind_never_blocks_the_sender(tmp_path):
    import time

    path = str(tmp_path / "slow.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)  # never read: the kernel queue fills after a few datagrams
    n = SystemdNotifier(path)
    started = time.monotonic()
    for _ in range(500):
        n.watchdog()
    assert time.monotonic() - started < 2.0
    server.close()


def test_watchdog_loop_extends_while_starting_and_stops_pinging_when_terminal(monkeypatch, tmp_path):
    import asyncio

    from health.notify import watchdog_loop

    path = str(tmp_path / "wd.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.setblocking(False)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping every 0.1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    n = SystemdNotifier(path)
    state = {"starting": True, "terminal": False}

    async def run_for(seconds):
        loop = asyncio.create_task(watchdog_loop(n, lambda: state["starting"], lambda: state["terminal"]))
        await asyncio.sleep(seconds)
        loop.cancel()
        got = []
        while True:
            try:
                got.append(server.recv(4096).decode())
            except BlockingIOError:
                return got

    got = asyncio.run(run_for(0.25))
    assert "EXTEND_TIMEOUT_USEC=300000" in got and "WATCHDOG=1" in got, got
    state.update(starting=False, terminal=True)
    assert asyncio.run(run_for(0.25)) == []
