"""``bench.serving_overhead --interleave --alone``: the servers not measured are stopped over a
window, the measured one runs, and every one is stopped again after it, with the Ray workers that
appeared in its window (real processes, titled as Ray titles its workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

from bench.serving_overhead import alone, ray_workers, server_pids
from chaos.harness import MARKER_ENV

# a server stand-in: a process with a child (an engine core)
SERVER = [sys.executable, "-c", "import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]


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
    head = SimpleNamespace(marker=uuid.uuid4().hex)
    procs: list[subprocess.Popen] = []

    def ray_process(title: str) -> int:
        """A process of the Ray head (its marker in the environment) titled ``title``."""
        proc = subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep 600'], start_new_session=True,
                                env={**os.environ, MARKER_ENV: head.marker})
        procs.append(proc)
        deadline = time.monotonic() + 10
        while proc.pid not in ray_workers(head) and title != "ray::IDLE" and time.monotonic() < deadline:
            time.sleep(0.02)  # exec'd
        return proc.pid

    try:
        idle = ray_process("ray::IDLE")
        servers, workers = {}, {}
        for kind in ("a", "b"):
            before = ray_workers(head)
            procs.append(proc := subprocess.Popen(SERVER, start_new_session=True))
            worker = ray_process(f"ray::Worker{kind}")
            servers[kind] = SimpleNamespace(proc=proc)
            workers[kind] = {p: t for p, t in ray_workers(head).items() if before.get(p) != t}
            assert set(workers[kind]) == {worker}  # not the idle one, not the other server's
        workers["b"][999_999_999] = 1  # one gone: left out
        deadline = time.monotonic() + 10
        while min(len(server_pids(servers[k], workers[k])) for k in servers) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the child started
        every = {k: server_pids(servers[k], workers[k]) for k in servers}
        assert all(len(pids) == 3 for pids in every.values()), every  # itself, its child, its worker
        for pids in every.values():
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
        with alone("a", servers, workers, head, thaw_s=0.0):
            assert stopped(every["a"]) == {False} and stopped(every["b"]) == {True}
            late = ray_process("ray::WorkerLate")  # a's, started in its window (a standby's replacement)
        assert stopped(every["a"] + every["b"] + [late]) == {True} and late in workers["a"]
        assert stopped([idle]) == {False}  # the head's idle workers are left alone
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
