"""A starved engine is not a hung one.

A healthy engine can take no step for longer than ``hang_timeout_s`` when the host does not
give it a CPU: vLLM's ``mp`` CPU worker binds its OpenMP threads to fixed cores by itself
(``VLLM_CPU_OMP_THREADS_BIND=auto``: with TP=1 on 2 cores every engine's worker takes core 0),
so a second engine, a batch job or a noisy neighbour saturating those cores leaves its threads
runnable and waiting. A rebuild does not help there (the new worker binds the same cores) and
costs every stream a recovery. A hung engine's threads do not wait for a CPU: a deadlocked or
SIGSTOPped worker sleeps or is stopped, and one spinning in a loop runs.

So a thread that is runnable (state ``R`` in ``/proc/<pid>/task/<tid>/stat``) at both ends of a
short window, and ran for little of it (its CPU time, the first field of ``schedstat``), was
kept waiting for a CPU. (The kernel's own run-queue wait, ``schedstat``'s second field, is
added only when a thread gets its CPU back: a thread starved throughout shows none.) Read for
the engine's processes on this host (its engine core and its local workers); workers on other
hosts cannot be read, and their stall stays a hang.
"""

from __future__ import annotations

import os
from typing import Iterable

# A thread runnable at both ends of the window that ran for less than this share of it:
# starved. 0.75: one that shares its core with one other busy thread (half each) is not.
STARVED_SHARE = 0.75

Sample = dict[int, tuple[bytes, int]]  # thread id -> (its state, the CPU time it has run, ns)


def sample(pids: Iterable[int]) -> Sample:
    """Each thread of ``pids``: its scheduler state and its CPU time so far. Threads (and
    processes) that cannot be read are left out: gone, or not on this host."""
    out: Sample = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                    state = fh.read().rsplit(b")", 1)[1].split()[0]
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as fh:
                    out[int(tid)] = (state, int(fh.read().split()[0]))
            except (OSError, IndexError, ValueError):  # the thread ended meanwhile
                pass
    return out


def starved_share(before: Sample, after: Sample, window_s: float) -> float:
    """The largest share of ``window_s`` that a thread runnable at both ends of it spent
    waiting rather than running (0.0: none runnable throughout, or nothing read)."""
    if window_s <= 0:
        return 0.0
    window_ns = window_s * 1e9
    shares = [1.0 - min(window_ns, max(0, ran - before[tid][1])) / window_ns
              for tid, (state, ran) in after.items() if state == b"R" and before.get(tid, (b"",))[0] == b"R"]
    return max(shares, default=0.0)
