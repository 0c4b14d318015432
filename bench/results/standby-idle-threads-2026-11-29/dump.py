"""The idle standby worker's threads that run (2 s of schedstat each) and a py-spy dump of it
(--native): where its main thread waits. A daemon with its defaults on a Ray head of 2 CPUs.

    PYTHONPATH=. .venv/bin/python bench/results/standby-idle-threads-2026-11-29/dump.py
"""
import os
import subprocess
import time
from pathlib import Path

from threads import settled_daemon  # the probe beside this one: a script's own directory is first on sys.path

with settled_daemon() as server:
    pid = server.status()["standby"]["workers"][0]["pid"]
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        if comm.startswith("ray::"):
            run0 = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[2])
            time.sleep(2)
            run1 = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[2])
            wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
            print(f"tid {tid} {comm}: {(run1 - run0) / 2:.1f} runs/s, wchan {wchan}", flush=True)
    out = subprocess.run([".venv/bin/py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
    print(out.stdout[-6000:], out.stderr[-500:], flush=True)
