"""The real-hosts fixture itself (``chaos.netns``): namespaces on a switch, each a host with its
own address; a partition stops every packet either way and a heal lets them through again; a
rate limit slows a transfer; everything it made is gone after ``close``, also when the code
using it raised."""

from __future__ import annotations

import subprocess
import time

import pytest

from chaos.netns import Hosts, available

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # needs root: CI runs it

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7070)); s.listen()
while True:
    c, _ = s.accept()
    try:
        c.sendall(b"x" * int(sys.argv[2]))
    except OSError:  # a probe that connects and leaves at once (``Hosts.reachable``)
        pass
    c.close()
"""

CLIENT = """
import socket, sys, time
t = time.monotonic()
with socket.create_connection((sys.argv[1], 7070), timeout=float(sys.argv[2])) as c:
    n = 0
    while (b := c.recv(65536)):
        n += len(b)
print(n, round(time.monotonic() - t, 3))
"""


def in_host(hosts: Hosts, i: int, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", hosts.hosts[i].ns, "/usr/bin/python3", "-c", code, *args],
                          capture_output=True, text=True, timeout=timeout)


def wait_listening(hosts: Hosts, i: int, port: int) -> None:
    deadline = time.monotonic() + 60
    while f":{port}" not in subprocess.run(["ip", "netns", "exec", hosts.hosts[i].ns, "ss", "-ltn"],
                                           capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "the server in the namespace never listened"
        time.sleep(0.2)


@pytest.fixture
def hosts():
    if why := available():
        pytest.fail(f"real hosts need root and iproute2 (CI installs it): {why}")
    h = Hosts(2).make()
    try:
        yield h
    finally:
        h.close()
        assert h.leftovers() == []


def test_hosts_reach_each_other_until_partitioned_and_again_when_healed(hosts):
    size = 200_000
    server = subprocess.Popen(["ip", "netns", "exec", hosts.hosts[0].ns, "/usr/bin/python3", "-c", SERVER,
                               hosts.hosts[0].address, str(size)])
    try:
        wait_listening(hosts, 0, 7070)
        got = in_host(hosts, 1, CLIENT, hosts.hosts[0].address, "5")
        assert got.stdout.split()[0] == str(size), got.stderr  # host 1 → host 0 over the switch
        assert hosts.reachable(0, 7070)  # this namespace → host 0

        hosts.partition(0)
        cut = in_host(hosts, 1, CLIENT, hosts.hosts[0].address, "2")
        assert cut.returncode != 0 and "timed out" in cut.stderr, (cut.stdout, cut.stderr)  # dropped, not refused
        assert not hosts.reachable(0, 7070)
        assert server.poll() is None and server.pid in hosts.pids(0)  # alive behind the partition

        hosts.heal(0)
        deadline = time.monotonic() + 10
        while not hosts.reachable(0, 7070):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        clean = float(in_host(hosts, 1, CLIENT, hosts.hosts[0].address, "10").stdout.split()[1])

        hosts.partition(0, side="head")  # the head's side: this namespace loses host 0, the hosts do not
        assert not hosts.reachable(0, 7070)
        got = in_host(hosts, 1, CLIENT, hosts.hosts[0].address, "5")
        assert got.stdout.split()[0] == str(size), got.stderr  # host 1 → host 0 still passes
        assert f"blackhole {hosts.hosts[0].address}" in hosts.leftovers()
        hosts.heal(0)
        assert hosts.reachable(0, 7070)

        hosts.slow(0, rate="400kbit", burst="16kbit", latency="2s")
        slow = in_host(hosts, 1, CLIENT, hosts.hosts[0].address, "30").stdout.split()
        assert slow[0] == str(size)
        assert float(slow[1]) > 2.5 > clean, (slow, clean)  # 200 kB at 400 kbit/s: about 4 s
        hosts.unslow(0)
    finally:
        server.kill()
        server.wait()


def test_close_removes_everything_even_when_the_test_raised():
    if why := available():
        pytest.fail(f"real hosts need root and iproute2 (CI installs it): {why}")
    h = Hosts(2)
    with pytest.raises(RuntimeError):
        with h:
            sleeper = subprocess.Popen(["ip", "netns", "exec", h.hosts[1].ns, "sleep", "600"])
            h.partition(0, side="head")  # a route in this namespace: it must go too
            time.sleep(0.5)
            assert h.leftovers()  # made
            raise RuntimeError("a test failing half-way")
    assert h.leftovers() == []
    assert sleeper.wait(10) == -9  # the host's processes went with it (a power cut)
