"""``bench.serving_overhead --interleave --alone``: the servers not measured are stopped over a
window, the measured one runs, and every one is stopped again after it (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

from bench.serving_overhead import alone, server_pids

# a server stand-in: a process with a child (an engine core), and a "Ray worker" apart from it
SERVER = [sys.executable, "-c", "import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def stopped(pids: list[int]) -> set[bool]:
    """Whether each of ``pids`` is stopped, once none is on its way (a signal is delivered when
    its process next runs: a process that just got SIGSTOP may still show "R" for a moment)."""
    def states():
        out = set()
        for pid in pids:
            with open(f"/proc/{pid}/stat") as fh:
                out.add(fh.read().rsplit(")", 1)[1].split()[0])
        return out

    deadline = time.monotonic() + 5
    while "R" in (now := states()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return {s == "T" for s in now}


def test_only_the_measured_server_runs_over_its_window():
    procs, every = [], {}
    try:
        servers, workers = {}, {}
        for kind in ("a", "b"):
            proc = subprocess.Popen(SERVER)
            worker = subprocess.Popen(SLEEPER)
            procs += [proc, worker]
            servers[kind], workers[kind] = SimpleNamespace(proc=proc), {worker.pid, 999_999_999}  # one gone
        deadline = time.monotonic() + 10
        while min(len(server_pids(servers[k], workers[k])) for k in servers) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the child started
        every = {k: server_pids(servers[k], workers[k]) for k in servers}
        assert all(len(pids) == 3 for pids in every.values()), every  # itself, its child, its worker
        for pids in every.values():
            for pid in pids:
                subprocess.run(["kill", "-STOP", str(pid)], check=True)
        with alone("a", servers, workers, thaw_s=0.0):
            assert stopped(every["a"]) == {False} and stopped(every["b"]) == {True}
        assert stopped(every["a"] + every["b"]) == {True}
    finally:
        for pid in {p for pids in every.values() for p in pids} - {p.pid for p in procs}:
            subprocess.run(["kill", "-KILL", str(pid)], check=False)  # the children
        for proc in procs:
            proc.kill()
            proc.wait()
