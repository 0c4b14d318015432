"""A stand-in for a contended host: takes each core away from everything else for ``ON`` ms in
every ``ON + OFF`` ms, as a hypervisor that time-slices this VM's vCPUs with other tenants' does
(the guest sees its time pass while it does not run). One process per core, bound to it, at
real-time priority (``SCHED_FIFO``), so that no process of the guest runs on that core meanwhile,
whatever its niceness or session. Root only. Stops on SIGTERM or SIGINT.

    .venv/bin/python bench/results/prefix-routing-steal-2026-11-29/steal.py ON_MS OFF_MS

(the kernel's own limit on real-time tasks, ``sched_rt_runtime_us``, 95 % by default, stays in force.)
"""
from __future__ import annotations

import os
import signal
import sys
import time


def take(core: int, on_s: float, off_s: float) -> None:
    os.sched_setaffinity(0, {core})
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    parent = os.getppid()
    while os.getppid() == parent:  # never outlives its parent
        until = time.monotonic() + on_s
        while time.monotonic() < until:
            pass
        time.sleep(off_s)


def main() -> None:
    on_s, off_s = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
    children = []
    for core in sorted(os.sched_getaffinity(0)):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            take(core, on_s, off_s)
        children.append(pid)
    print(f"steal: {len(children)} processes {children}, {on_s * 1000:g} ms of every {(on_s + off_s) * 1000:g}", flush=True)

    def stop(*_):
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for pid in children:
            os.waitpid(pid, 0)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
