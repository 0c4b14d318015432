"""CPU starvation: keep a process's threads off their cores for a while, as a host whose cores
another engine or job saturates does, with the threads runnable all along (a SIGSTOPped
process is not: that is a hang).

    python -m chaos.starve --pid PID --seconds 7 [--bind]

Busy processes on each core the target's threads may run on, one real-time (``SCHED_FIFO``) (vLLM's
``mp`` CPU worker binds its OpenMP threads to cores of its own: with TP=1 on 2 cores, core 0;
``--bind`` binds an unbound target, a Ray worker, to the first core meanwhile). The
kernel's real-time throttling (``kernel.sched_rt_runtime_us``: 95 % of each second to real-time
tasks) is lifted meanwhile and put back afterwards whatever happens; what the kernel still
leaves to normal tasks (``HOGS``) goes to two more at nice -20. Each busy process also ends by
itself at its deadline. Needs root
(``CAP_SYS_NICE`` and the sysctl). Refuses a target that may run on every core: the daemon
and everything else would starve with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

RT_RUNTIME = "/proc/sys/kernel/sched_rt_runtime_us"

HOG = """
import os, sys, time
deadline = float(sys.argv[2])
os.sched_setaffinity(0, {int(sys.argv[1])})
if sys.argv[3] == "fifo":
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
else:
    os.setpriority(os.PRIO_PROCESS, 0, -20)
print("on", flush=True)
while time.monotonic() < deadline:
    pass
"""
# Per core: one real-time busy process, and two at nice -20 for what real-time tasks must leave
# to normal ones (since Linux 6.12 a deadline server gives them 50 ms of every second, whatever
# kernel.sched_rt_runtime_us says): a nice-0 thread then gets ~0.03 % of the core.
HOGS = ("fifo", "nice", "nice")


def cores_of(pid: int) -> set[int]:
    """The cores any thread of ``pid`` may run on."""
    cores: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return cores


def pin(pid: int, cores: set[int]) -> dict[int, set[int]]:
    """Bind every thread of ``pid`` to ``cores``; returns each thread's affinity before."""
    before = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            pass
    return before


def unpin(before: dict[int, set[int]]) -> None:
    for tid, cores in before.items():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass


def starve(pid: int, seconds: float, cores: set[int] | None = None, bind: bool = False) -> dict:
    """Keep ``cores`` (by default every core ``pid``'s threads may use) busy with real-time
    processes for ``seconds``; returns when they are done. ``bind``: bind ``pid``'s threads to
    ``cores`` (by default the machine's first) meanwhile, as vLLM's ``mp`` CPU worker binds
    itself, and give them their own affinity back afterwards. ``monotonic``: when the busy
    processes started."""
    machine = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    if bind and cores is None:
        cores = {min(machine)}
    cores = cores if cores is not None else cores_of(pid)
    if not cores or cores >= machine:
        raise SystemExit(f"pid {pid} may run on cores {sorted(cores)}: starving them all would starve the host")
    with open(RT_RUNTIME) as fh:
        saved = fh.read().strip()
    hogs: list[subprocess.Popen] = []
    bound: dict[int, set[int]] = {}
    try:
        bound = pin(pid, cores) if bind else {}
        with open(RT_RUNTIME, "w") as fh:
            fh.write("-1")
        deadline = time.monotonic() + seconds
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(core), str(deadline), mode], stdout=subprocess.PIPE)
                for core in sorted(cores) for mode in HOGS]
        for hog in hogs:  # each is real-time on its core once it says so
            if hog.stdout.readline().strip() != b"on":
                raise RuntimeError(f"a busy process could not take its core: exit {hog.wait()}")
        at = time.monotonic()
        for hog in hogs:
            hog.wait(seconds + 30)
        return {"starved_pid": pid, "cores": sorted(cores), "seconds": seconds, "monotonic": at}
    finally:
        for hog in hogs:
            if hog.poll() is None:
                hog.kill()
                hog.wait()
            hog.stdout.close()
        with open(RT_RUNTIME, "w") as fh:
            fh.write(saved)
        unpin(bound)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.starve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--bind", action="store_true", help="bind the process to the first core meanwhile")
    args = parser.parse_args(argv)
    json.dump(starve(args.pid, args.seconds, bind=args.bind), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
