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
kept waiting for a CPU; unless the engine's threads together ran for much of the window (an
engine spinning in a loop keeps some of its own threads waiting). (The kernel's own run-queue wait, ``schedstat``'s second field, is
added only when a thread gets its CPU back: a thread starved throughout shows none.) Read for
the engine's processes on this host (its engine core and its local workers); workers on other
hosts cannot be read, and their stall stays a hang.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterable

from executor import procfs

# A thread runnable at both ends of the window that ran for less than this share of it:
# starved. 0.75: one that shares its core with one other busy thread (half each) is not.
STARVED_SHARE = 0.75
# ... and the engine's threads together ran for less than this share of the window (half a
# core): a hung engine spinning in a loop, or several spinning beside each other, burns CPU.
BUSY_SHARE = 0.5


@dataclass
class Sample:
    """Each thread of some processes at one moment: thread id -> (its scheduler state, the CPU
    time it has run so far, ns)."""

    threads: dict[int, tuple[bytes, int]] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)


def sample(procs: Iterable[tuple[int, int | None]]) -> Sample:
    """Each thread of ``procs`` (pid, start time in clock ticks since boot, or None: not
    checked) now. A process whose start time differs is another one on a pid reused since it
    was recorded, and is left out, as are threads (and processes) that cannot be read: gone, or
    not on this host. Reads ``/proc`` only (two small files per thread, one per process)."""
    out = Sample()
    for pid, start in procs:
        try:
            if start is not None and procfs.start_time(pid) != start:
                continue
            tids = os.listdir(f"/proc/{pid}/task")
        except (OSError, IndexError, ValueError):
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                    state = fh.read().rsplit(b")", 1)[1].split()[0]
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as fh:
                    out.threads[int(tid)] = (state, int(fh.read().split()[0]))
            except (OSError, IndexError, ValueError):  # the thread ended meanwhile
                pass
    out.at = time.monotonic()
    return out


def starved_share(before: Sample, after: Sample) -> float:
    """The largest share of the window between the samples that a thread runnable at both ends
    of it spent waiting rather than running; 0.0 when none was runnable throughout, when the
    threads together ran for ``BUSY_SHARE`` of the window or more, or when nothing was read."""
    window_ns = (after.at - before.at) * 1e9
    if window_ns <= 0:
        return 0.0
    ran = {tid: max(0, t - before.threads[tid][1]) for tid, (_, t) in after.threads.items() if tid in before.threads}
    if sum(ran.values()) >= BUSY_SHARE * window_ns:
        return 0.0
    return max((1.0 - min(window_ns, ran[tid]) / window_ns for tid, (state, _) in after.threads.items()
                if tid in ran and state == b"R" and before.threads[tid][0] == b"R"), default=0.0)


@dataclass
class Episode:
    generation: int
    first: float  # when its stalled engine was first seen starved
    last: float  # ... and last


class Episodes:
    """Each replica's starvation episode: from when its stalled engine was first seen starved
    to when it was last seen starved, until the engine steps again (``moved``)."""

    def __init__(self, count_cap_s: float):
        self.count_cap_s = count_cap_s  # at most this much counted per sighting (the checks' period)
        self._by_replica: dict[int, Episode] = {}

    def _of(self, replica: int, generation: int) -> Episode | None:
        episode = self._by_replica.get(replica)
        return episode if episode is not None and episode.generation == generation else None

    def last_seen(self, replica: int, generation: int) -> float:
        """When ``generation`` was last seen starved (0.0: not in this episode)."""
        episode = self._of(replica, generation)
        return episode.last if episode is not None else 0.0

    def seen(self, replica: int, generation: int, now: float, window_s: float) -> tuple[float, float]:
        """A sighting of ``generation`` starved at ``now``, over a window of ``window_s``.
        Returns how long it has been starved in this episode (0.0: a new one) and how many
        seconds to count for this sighting."""
        episode = self._of(replica, generation)
        if episode is None:
            self._by_replica[replica] = Episode(generation, now, now)
            return 0.0, window_s
        counted = min(now - episode.last, self.count_cap_s)
        episode.last = now
        return now - episode.first, counted

    def moved(self, replica: int, generation: int, last_progress: float) -> float | None:
        """The episode's length if ``generation`` stepped after it was last seen starved (the
        episode then ends), else None."""
        episode = self._of(replica, generation)
        if episode is None or last_progress <= episode.last:
            return None
        del self._by_replica[replica]
        return episode.last - episode.first
