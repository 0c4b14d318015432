"""What the ready standby's liveness watch costs an idle daemon: a daemon with its defaults on a
Ray head of 2 CPUs (the 2026-11-29 probe's ``settled_daemon``), its standby ready, then
``window`` seconds without a request: the CPU (``/proc/<pid>/task/*/schedstat``, ns) and the
times scheduled in of the daemon's process, its Ray agent, the head's ``gcs_server`` and
``raylet``, and the standby's worker. Run once per checkout, the daemon's code from
``PYTHONPATH`` (before: Ray's actor table read every second; after: the standby's processes
waited on, the table read every 30 s):

    PYTHONPATH=/path/to/checkout .venv/bin/python bench/results/standby-watch-2026-12-03/idle.py LABEL [window_s]
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "threads_1129", Path(__file__).parents[1] / "standby-idle-threads-2026-11-29" / "threads.py")
_before = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_before)


def schedstat(pid: int) -> tuple[int, int]:
    """(CPU ns, times scheduled in) over every thread of ``pid``."""
    cpu = runs = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except OSError:
            continue
        cpu, runs = cpu + int(fields[0]), runs + int(fields[2])
    return cpu, runs


def find(*needles: bytes) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            return int(pid)
    raise RuntimeError(f"no process with {needles}")


def main() -> None:
    label, window = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    with _before.settled_daemon("daemon") as server:
        standby = server.status()["standby"]
        pids = {"daemon": server.proc.pid, "ray agent": find(b"vllm-supervisor: ray agent"),
                "gcs_server": find(b"gcs_server"), "raylet": find(b"raylet", b"--node_manager_port"),
                "standby worker": standby["workers"][0]["pid"]}
        before = {k: schedstat(p) for k, p in pids.items()}
        time.sleep(window)
        after = {k: schedstat(p) for k, p in pids.items()}
        watch = server.status()["standby"].get("watch", "(no such field: polled)")
    print(f"{label}: {window:.0f} s idle, the standby watched: {watch}; CPU ms/s and runs/s: " + ", ".join(
        f"{k} {(after[k][0] - before[k][0]) / window / 1e6:.2f} / {(after[k][1] - before[k][1]) / window:.1f}"
        for k in pids), flush=True)


if __name__ == "__main__":
    main()
