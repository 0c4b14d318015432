"""The ready standby's processes rest while they wait: under ``SCHED_IDLE``, and its workers stopped.

A ready standby does almost nothing: its parked worker's Ray and gRPC threads wake about 64 times
a second for 4 ms of a core, and the engine core's fork server sleeps. On a host whose cores the
model takes (vLLM's CPU backend), that small share still competes with the serving threads.
Measured within one daemon at saturation on 2 cores (docs/benchmarks.md, "The standby toggled
within one daemon"), the first token came sooner with the standby's threads under ``SCHED_IDLE``
(ratio median 0.86, lower in 13 of 18 blocks), as with the standby stopped outright; under
``SCHED_BATCH`` (which only gives up preempting on wake-up) it did not.

So once the standby is ready, every thread of its processes on this host (Linux policies are per
thread) is set to ``SCHED_IDLE`` (``sched(7)``): it runs only on a core nothing else wants. Only
where the daemon can take it back: it holds ``CAP_SYS_NICE``, or the process's ``RLIMIT_NICE``
allows nice 0 (leaving ``SCHED_IDLE`` counts as raising the priority to the kernel; systemd's
``LimitNICE=+0``, which the units in ``systemd/`` set). Elsewhere the standby waits at the normal
policy, as before.

The claim of the build the standby is kept for takes every rested process back to ``SCHED_OTHER``
before the build runs in it (an adopted worker) or forks from it (the engine core a fork server
starts inherits the policy of the thread that forks it); the claim of any other build takes back
the fork server only, which then does not rest again until that build's fork is done. Threads
started meanwhile inherit ``SCHED_IDLE``; ``restore`` reads the threads again, so they are taken
back too. Niceness is untouched (Ray's ``worker_niceness`` stays
as ``executor.ray_v2`` sets it).

Under ``SCHED_IDLE`` the parked worker's Ray and gRPC threads still wake, 56 times a second for
3 ms of a core (measured on 2026-12-05); stopped (SIGSTOP), it does not run at all. So a ready
standby's workers on this host are also stopped (``stop``), which needs no privilege, and every
claim that takes them continues them first (``cont``), as does every discard before it kills them.
At saturation on 2 cores the stop is not shown to matter: one run of ten rounds served the first
token sooner with the standby stopped (0.82 ms, resolved), the next two, 24 rounds, did not (the
standby stopped 1.047× the one resting under ``SCHED_IDLE``, within the noise; docs/benchmarks.md,
"The standby's price split"). What it saves for certain is the idle standby's own wake-ups.
The fork server is not stopped: it sleeps in a read (no wake-up to save), and a stopped one would
outlive a daemon killed with SIGKILL, since only its read of the daemon's end would end it. A
stopped Ray worker does not: Ray SIGKILLs an actor whose owner died, or that ``ray.kill`` could
not reach, 5 s later, and its raylet's death kills it at once (measured on Ray 2.60); the crash
reaper SIGKILLs it with the daemon's tree.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

CAP_SYS_NICE = 23
NICE_0 = 20  # RLIMIT_NICE's value that allows nice 0: its ceiling is 20 - limit


def threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (none once it has exited)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def has_cap_sys_nice() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def nice_limit(pid: int) -> int:
    """``pid``'s soft ``RLIMIT_NICE`` (``/proc/<pid>/limits``; 0 when unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max nice priority"):
                soft = line.split()[3]
                return 1 << 30 if soft == "unlimited" else int(soft)
    except OSError:
        pass
    return 0


def can_rest(pid: int, privileged: bool) -> bool:
    """Whether ``pid`` can be taken back from ``SCHED_IDLE``: the daemon is ``privileged``
    (``CAP_SYS_NICE``) or ``pid``'s ``RLIMIT_NICE`` allows nice 0."""
    return privileged or nice_limit(pid) >= NICE_0


def set_policy(pid: int, policy: int) -> int:
    """Every thread of ``pid`` under ``policy`` (priority 0); how many were set. A thread or a
    process that exits meanwhile is skipped."""
    done = 0
    for tid in threads(pid):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done += 1
    return done


def rest(pids: list[int]) -> tuple[list[int], list[int]]:
    """Each of ``pids`` that ``can_rest`` under ``SCHED_IDLE``: (the pids set, those left at
    the normal policy). A process that refuses (another owner) is left as it was, and so is the
    daemon's own (a standby is never the daemon; a test's fake may name it)."""
    privileged = has_cap_sys_nice()
    rested, left = [], []
    for pid in (p for p in pids if p != os.getpid()):
        try:
            if can_rest(pid, privileged) and set_policy(pid, os.SCHED_IDLE):
                rested.append(pid)
                continue
        except PermissionError:  # another owner's process: as it was
            restore([pid])
        left.append(pid)
    return rested, left


def restore(pids: list[int]) -> list[int]:
    """Every thread of ``pids`` under ``SCHED_IDLE`` back to ``SCHED_OTHER``; the pids that
    refused (none expected: ``rest`` set only those it can take back). Only ``SCHED_IDLE``
    threads: a pid that died and was given to another process keeps whatever policy it has."""
    refused = []
    for pid in pids:
        try:
            for tid in threads(pid):
                with contextlib.suppress(ProcessLookupError):
                    if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except PermissionError:
            refused.append(pid)
    return refused


def stop(pids: list[int]) -> list[int]:
    """Each of ``pids`` stopped (SIGSTOP): the pids stopped. Never the daemon's own process (a
    test's fake may name it), nor one that is gone or belongs to another user."""
    stopped = []
    for pid in pids:
        if not pid or pid in (os.getpid(), 1):
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            continue
        stopped.append(pid)
    return stopped


def cont(pids: list[int]) -> None:
    """Each of ``pids`` continued (SIGCONT); one that is gone is skipped. A pid given to another
    process meanwhile takes no harm: a running process ignores SIGCONT unless it asked for it."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
