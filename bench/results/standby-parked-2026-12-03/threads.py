"""The ready standby's threads, parked (the defaults since 2026-12-03) and not parked
(``daemon_without_park``): for each kind, a daemon on a Ray head of 2 CPUs, its standby ready, 5 s
of quiet, then every thread of the standby's Ray worker and of the fork server read from
``/proc/<pid>/task/<tid>`` over ``window`` seconds without a request (wake-ups a second, CPU ms a
second, by thread name), as ``bench/results/standby-idle-threads-2026-11-29/threads.py`` read them.

    PYTHONPATH=. .venv/bin/python bench/results/standby-parked-2026-12-03/threads.py [window_s] [kind ...]
"""

import importlib.util
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.common import RayHead
from bench.serving_overhead import start

_spec = importlib.util.spec_from_file_location(
    "threads_1129", Path(__file__).parents[1] / "standby-idle-threads-2026-11-29" / "threads.py")
_before = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_before)
threads, serving_worker = _before.threads, _before.serving_worker


def measure(kind: str, window: float) -> None:
    work = Path(tempfile.mkdtemp(prefix="standby-parked-"))
    head = RayHead(num_cpus=2).start()
    try:
        server = start(kind, work, head)
        try:
            time.sleep(5)
            standby = server.status()["standby"]
            pids = {"standby worker": standby["workers"][0]["pid"], "fork server": standby["forkserver_pid"],
                    "serving worker": serving_worker(standby["workers"][0]["pid"])}
            before = {k: threads(p) for k, p in pids.items() if p}
            time.sleep(window)
            after = {k: threads(p) for k, p in pids.items() if p}
        finally:
            server.stop()
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"## {kind}, {window:.0f} s idle", flush=True)
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


def main() -> None:
    window = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    for kind in sys.argv[2:] or ["daemon", "daemon_without_park"]:
        measure(kind, window)


if __name__ == "__main__":
    main()
