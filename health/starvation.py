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
engine spinning in a loop keeps some of its own threads waiting). The kernel's own run-queue
wait, ``schedstat``'s second field, is added only when a thread gets its CPU back (a thread
starved throughout shows none), and then all at once: a thread whose wait grew within the
window by more than ``CAME_BACK_S`` beyond the window was kept waiting that long until just
now. That too is starvation, whatever the engine does next: a starvation that ends as the
stall is checked leaves an engine busy catching up, not a hung one. And a window read busy
while a thread waited is read again ``SPIN_S`` later: vLLM's engine core polls for a second for
the next reply of a starved worker that got a moment to send one. Read for the engine's
processes on this host (its engine core and its local workers); workers on other hosts cannot
be read, and their stall stays a hang.
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
# A thread whose run-queue wait grew by this much more than the window was kept off a CPU that
# long without a break, until within the window: no engine's own threads keep each other
# waiting a second at a time (the kernel's slices are milliseconds).
CAME_BACK_S = 1.0
# vLLM's shared-memory reader polls for a second after each message it reads (``SpinCondition``,
# ``busy_loop_s = 1``): an engine core whose starved worker got a moment to reply spins that long,
# a busy engine that is not hung. A window read busy while a thread of the engine waited is read
# again this much later, when any such spin is over (``Window.ambiguous``).
SPIN_S = 1.0


@dataclass
class Sample:
    """Each thread of some processes at one moment: thread id -> (its scheduler state, the CPU
    time it has run so far, ns); and its run-queue wait so far (ns) and its "pid/name"."""

    threads: dict[int, tuple[bytes, int]] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)
    names: dict[int, str] = field(default_factory=dict)  # thread id -> "pid/name", for a hang's detail
    delays: dict[int, int] = field(default_factory=dict)  # thread id -> its run-queue wait so far, ns


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
                    head, tail = fh.read().rsplit(b")", 1)
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as fh:
                    ran, delay = fh.read().split()[:2]
                out.threads[int(tid)] = (tail.split()[0], int(ran))
                out.delays[int(tid)] = int(delay)
                out.names[int(tid)] = f"{pid}/{head.split(b'(', 1)[1].decode(errors='replace')}"
            except (OSError, IndexError, ValueError):  # the thread ended meanwhile
                pass
    out.at = time.monotonic()
    return out


@dataclass
class Window:
    """What the threads of an engine did between two samples."""

    seconds: float
    threads: int  # read at both ends
    runnable: int  # ... runnable (``R``) at both ends
    ran: float  # the share of the window they ran, together
    waited: float  # the largest share of it one runnable throughout spent waiting for a CPU
    busiest: str = ""  # the thread that ran most ("pid/name"), and its share
    busiest_ran: float = 0.0
    came_back_s: float = 0.0  # the longest wait for a CPU that ended within the window, beyond it

    @property
    def starved_share(self) -> float:
        """``waited``, unless the threads together ran for ``BUSY_SHARE`` of the window or more;
        1.0 when a thread came back from a wait of ``CAME_BACK_S`` or more."""
        if self.came_back_s >= CAME_BACK_S:
            return 1.0
        return 0.0 if self.ran >= BUSY_SHARE else self.waited

    @property
    def ambiguous(self) -> bool:
        """Busy, but a thread of the engine waited as a starved one does: the busy one may be
        vLLM's engine core polling for a second for a reply from that one (``SPIN_S``)."""
        return self.ran >= BUSY_SHARE and self.waited >= STARVED_SHARE and self.came_back_s < CAME_BACK_S

    def describe(self) -> str:
        """What the engine's threads did: for a hang's detail (why the engine was not taken for
        starved of CPU), and a starvation's log line."""
        if not self.threads:
            return "none of its threads could be read on this host"
        return (f"over {self.seconds:.1f} s its {self.threads} threads on this host ran {self.ran:.0%} of a core "
                f"(the most, {self.busiest}, {self.busiest_ran:.0%}), {self.runnable} runnable throughout, "
                f"the most kept waiting for a CPU {self.waited:.0%} of the time"
                + (f", one given a CPU back after waiting {self.came_back_s:.1f} s" if self.came_back_s >= 0.05 else ""))


def window(before: Sample, after: Sample) -> Window:
    """The threads read in both samples, over the window between them."""
    window_ns = (after.at - before.at) * 1e9
    if window_ns <= 0:
        return Window(0.0, 0, 0, 0.0, 0.0)
    ran = {tid: max(0, t - before.threads[tid][1]) for tid, (_, t) in after.threads.items() if tid in before.threads}
    runnable = [tid for tid, (state, _) in after.threads.items() if tid in ran and state == b"R" and before.threads[tid][0] == b"R"]
    busiest = max(ran, key=ran.__getitem__, default=None)
    came_back = max((after.delays[tid] - before.delays[tid] for tid in ran if tid in after.delays and tid in before.delays),
                    default=0)
    return Window(window_ns / 1e9, len(ran), len(runnable), sum(ran.values()) / window_ns,
                  max((1.0 - min(window_ns, ran[tid]) / window_ns for tid in runnable), default=0.0),
                  after.names.get(busiest, str(busiest)) if busiest is not None else "",
                  ran[busiest] / window_ns if busiest is not None else 0.0,
                  max(0.0, (came_back - window_ns) / 1e9))


def starved_share(before: Sample, after: Sample) -> float:
    """The largest share of the window between the samples that a thread runnable at both ends
    of it spent waiting rather than running; 0.0 when none was runnable throughout, when the
    threads together ran for ``BUSY_SHARE`` of the window or more, or when nothing was read;
    1.0 when a thread came back from a wait of ``CAME_BACK_S`` or more (``Window``)."""
    return window(before, after).starved_share


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
