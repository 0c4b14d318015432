"""CPU starvation: keep a process's threads off their cores for a while, as a host whose cores
another engine or job saturates does, with the threads runnable all along (a SIGSTOPped
process is not: that is a hang).

    python -m chaos.starve --pid PID --seconds 7 [--bind]

The target's threads go to the idle scheduling class (``SCHED_IDLE``, as ``chrt --idle``
would put them) and two busy processes at nice -20 take each of their cores: the threads stay
runnable and get about 0.002 % of the core. ``--bind`` binds them to the first core meanwhile,
as vLLM's ``mp`` CPU worker binds itself (a Ray worker is not bound). Afterwards each thread has
its own class and affinity back, whatever happens, and each busy process also ends by itself at
its deadline (counted from when they are all on: their start-up, slow on a loaded host, is not
part of it), or at once if its starter is gone before. The injecting thread keeps off those
cores meanwhile. Nothing host-wide is changed. Needs root (nice -20, and another user's threads).
Refuses when those cores are all the cores this process may use: everything would starve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HOG = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.setpriority(os.PRIO_PROCESS, 0, -20)
print("on", flush=True)
deadline = float(sys.stdin.readline() or 0)  # none: its starter is gone
while time.monotonic() < deadline:
    pass
"""
HOGS_PER_CORE = 2


def cores_of(pid: int) -> set[int]:
    """The cores any thread of ``pid`` may run on."""
    cores: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return cores


def demote(pid: int, cores: set[int] | None) -> dict[int, tuple[int, os.sched_param, set[int]]]:
    """Put every thread of ``pid`` in the idle class (and on ``cores`` if given); returns what
    each had before."""
    before = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            before[tid] = (os.sched_getscheduler(tid), os.sched_getparam(tid), os.sched_getaffinity(tid))
            if cores is not None:
                os.sched_setaffinity(tid, cores)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # the thread ended meanwhile
            pass
    return before


def restore(pid: int, before: dict[int, tuple[int, os.sched_param, set[int]]]) -> None:
    """Give each thread of ``pid`` what it had before ``demote``; a thread started meanwhile
    (in the idle class and on the bound cores, as its creator was) gets what the main thread had."""
    if not before:
        return
    try:
        tids = set(map(int, os.listdir(f"/proc/{pid}/task")))
    except OSError:  # the process is gone
        return
    main = before.get(pid) or next(iter(before.values()))
    for tid in tids:
        policy, param, cores = before.get(tid, main)
        try:
            os.sched_setscheduler(tid, policy, param)
        except OSError:
            pass
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass


def starve(pid: int, seconds: float, bind: bool = False) -> dict:
    """Starve ``pid`` for ``seconds``; returns when its threads have their class back.
    ``monotonic``: when the busy processes had all taken their cores."""
    machine = os.sched_getaffinity(0)
    cores = {min(machine)} if bind else cores_of(pid)
    if not cores or cores >= machine:
        raise SystemExit(f"pid {pid} would be starved on cores {sorted(cores)}, all this process may use: "
                         "everything would starve with it (--bind it to one core)")
    # This thread stays off the starved cores meanwhile: woken there behind a busy process at
    # nice -20, it would get about 1 % of the core until the kernel moved it, and the threads
    # it had not demoted yet would run on (seen: the worker stepping for seconds after "on").
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, machine - cores)  # pid 0: this thread alone
    hogs: list[subprocess.Popen] = []
    before: dict = {}
    try:
        hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(core)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                for core in sorted(cores) for _ in range(HOGS_PER_CORE)]
        for hog in hogs:  # each is at nice -20 on its core once it says so ...
            if hog.stdout.readline().strip() != b"on":
                raise RuntimeError(f"a busy process could not take its core: exit {hog.wait()}")
        # ... and busy from its deadline on (its start-up, slow on a loaded host, is not counted)
        deadline = time.monotonic() + seconds
        for hog in hogs:
            hog.stdin.write(f"{deadline}\n".encode())
            hog.stdin.close()
        before = demote(pid, cores if bind else None)
        at = time.monotonic()  # every thread demoted: starved from here
        for hog in hogs:
            hog.wait(seconds + 30)
        return {"starved_pid": pid, "cores": sorted(cores), "seconds": round(deadline - at, 2), "monotonic": at}
    finally:
        restore(pid, before)
        os.sched_setaffinity(0, own)
        for hog in hogs:
            if hog.poll() is None:
                hog.kill()
                hog.wait()
            hog.stdout.close()
            if not hog.stdin.closed:
                hog.stdin.close()


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
