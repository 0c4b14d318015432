"""What the ready standby's parks cost the cluster's GCS: a daemon with its defaults on a Ray head
of 2 CPUs (as ``bench/results/standby-idle-threads-2026-11-29/threads.py`` starts it), its standby
ready, then ``window`` seconds without a request: the CPU of the head's ``gcs_server`` and of the
standby's Ray worker over the window (``/proc/<pid>/stat``), and the records of ``park`` in the
cluster's task table at its end (``chaos.inject.task_records``, what ``ray list tasks`` reads).
Run once per checkout, the daemon's code from ``PYTHONPATH`` (``gcs.log``'s rounds ran this probe before it was made to
reuse the 2026-11-29 probe's daemon, which starts the same daemon on the same head):

    PYTHONPATH=/path/to/checkout .venv/bin/python bench/results/standby-park-events-2026-12-03/gcs.py LABEL [window_s]
"""

import importlib.util
import os
import sys
import time
import tomllib
from pathlib import Path

from chaos import inject

_spec = importlib.util.spec_from_file_location(
    "threads_1129", Path(__file__).parents[1] / "standby-idle-threads-2026-11-29" / "threads.py")
_before = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_before)

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_MS  # utime + stime


def gcs_pid(port: str) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"--gcs_server_port={port}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        except OSError:
            continue
    raise RuntimeError("no gcs_server")


def main() -> None:
    label, window = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    with _before.settled_daemon("daemon") as server:
        address = tomllib.loads(server.config_path.read_text())["ray"]["address"]
        pids = {"gcs_server": gcs_pid(address.rsplit(":", 1)[1]), "standby worker": server.status()["standby"]["workers"][0]["pid"]}
        before = {k: cpu_ms(p) for k, p in pids.items()}
        records0 = sum(inject.task_records(address, "park").values())
        time.sleep(window)
        cpu = {k: (cpu_ms(p) - before[k]) / window for k, p in pids.items()}
        records = sum(inject.task_records(address, "park").values())
        inject.disconnect()
    print(f"{label}: {window:.0f} s idle, CPU ms/s: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
          + f"; park records in the task table {records0} -> {records}", flush=True)


if __name__ == "__main__":
    main()
