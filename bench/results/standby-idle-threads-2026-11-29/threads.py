"""Which threads of the idle warm standby wake, and how often? A daemon with its defaults on a Ray
head of 2 CPUs, its standby ready and no request for ``window`` seconds: every thread of the
standby's Ray worker and of its engine core's fork server, read from ``/proc/<pid>/task/<tid>``
(``comm``, ``schedstat``) before and after, as wake-ups a second and CPU ms a second, by thread
name. The serving worker beside it for comparison.

    PYTHONPATH=. .venv/bin/python bench/results/standby-idle-threads-2026-11-29/threads.py [window_s]
"""

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

from bench.common import RayHead
from bench.serving_overhead import start


def threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (name, ns on a core, times run)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            run_ns, _, runs = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            out[int(tid)] = (name, int(run_ns), int(runs))
        except OSError:
            continue
    return out


def serving_worker(standby_pid: int) -> int | None:
    """The serving engine's Ray worker: the other ``ray::…WorkerProc`` process (the first build's
    worker started as a standby too, so both may carry that name)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != standby_pid:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"ray::") and b"WorkerProc" in cmd.split(b"\0")[0]:
                return int(pid)
    return None


@contextlib.contextmanager
def settled_daemon(kind: str = "daemon") -> Iterator[Any]:
    """A daemon (``bench.serving_overhead``'s ``kind``: its defaults) on a Ray head of 2 CPUs, its
    standby ready and 5 s of quiet after; stopped, with the head and its directory, after the block."""
    work = Path(tempfile.mkdtemp(prefix="standby-threads-"))
    head = RayHead(num_cpus=2).start()
    try:
        server = start(kind, work, head)
        try:
            time.sleep(5)
            yield server
        finally:
            server.stop()
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    window = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    with settled_daemon() as server:
        report(*sample(server, window), window)


def sample(server: Any, window: float) -> tuple[dict[str, int], dict, dict]:
    """The standby worker's, the fork server's and the serving worker's threads, read ``window``
    seconds apart: (pids, before, after)."""
    standby = server.status()["standby"]
    pids = {"standby worker": standby["workers"][0]["pid"], "fork server": standby["forkserver_pid"],
            "serving worker": serving_worker(standby["workers"][0]["pid"])}
    before = {k: threads(p) for k, p in pids.items() if p}
    time.sleep(window)
    return pids, before, {k: threads(p) for k, p in pids.items() if p}


def report(pids: dict[str, int], before: dict, after: dict, window: float) -> None:
    """Each process's threads by name: wake-ups a second and CPU ms a second over ``window``."""
    for what, now in after.items():
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
        for tid, (name, run_ns, runs) in now.items():
            _, run0, runs0 = before[what].get(tid, (name, 0, 0))
            row = by_name[name]
            row[0] += 1
            row[1] += (run_ns - run0) / 1e6 / window
            row[2] += (runs - runs0) / window
        total_cpu = sum(r[1] for r in by_name.values())
        total_wakes = sum(r[2] for r in by_name.values())
        print(f"{what} (pid {pids[what]}): {len(now)} threads, {total_cpu:.2f} CPU ms/s, {total_wakes:.1f} runs/s", flush=True)
        for name, (n, cpu, wakes) in sorted(by_name.items(), key=lambda kv: -kv[1][2]):
            if wakes >= 0.05 or cpu >= 0.01:
                print(f"  {name:24s} x{n:<3d} {wakes:7.2f} runs/s {cpu:7.3f} CPU ms/s", flush=True)


if __name__ == "__main__":
    main()
