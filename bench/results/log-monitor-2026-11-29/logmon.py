"""What each recovery leaves Ray's own processes to do while the daemon idles: one daemon (defaults:
Ray V2, warm standby) on a private Ray head, idle; every ``EVERY`` recoveries (``ray.kill`` of the
serving worker, the standby adopted, the next standby made) the head's processes' CPU over a 30 s
idle window (% of a core, from ``/proc``), the log monitor's open files, and the files in the
session's ``logs/``.

    PYTHONPATH=. .venv/bin/python bench/results/log-monitor-2026-11-29/logmon.py KILLS EVERY
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import tree_cpu_s
from bench.serving_overhead import process_name
from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, RayHead, marked_pids


def window(head: RayHead, seconds: float = 30.0) -> dict:
    pids = marked_pids(head.marker)
    before = tree_cpu_s(pids)
    time.sleep(seconds)
    after = tree_cpu_s(pids)
    out: dict[str, float] = {}
    for p in after:
        name = process_name(p)
        out[name] = out.get(name, 0.0) + 100 * (after[p] - before.get(p, after[p])) / seconds
    logmon = [p for p in after if process_name(p) == "log_monitor.py"]
    fds = len(os.listdir(f"/proc/{logmon[0]}/fd")) if logmon else None
    session_logs = Path("/tmp/ray/session_latest/logs").resolve()
    files = sum(1 for f in session_logs.iterdir() if f.is_file())
    return {"cpu_pct": {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])},
            "log_monitor_fds": fds, "log_files": files, "old": sum(1 for _ in (session_logs / "old").iterdir())
            if (session_logs / "old").is_dir() else 0}


def main() -> int:
    kills, every = int(sys.argv[1]), int(sys.argv[2])
    head = RayHead(num_cpus=2).start()
    try:
        with tempfile.TemporaryDirectory(prefix="logmon-") as tmp:
            # more than the default 5 recoveries in 10 min would end the daemon (its restart intensity)
            config = {"engine": {"max_model_len": 256}, "ray": {"address": head.address},
                      "supervisor": {"max_restarts": 1000}}
            with Daemon(Path(tmp), config, env=OPERATOR_ENV).start() as d:
                d.wait_ready()
                d.wait_standby()
                inject.prepare(head.address)
                print(0, window(head), flush=True)
                for k in range(1, kills + 1):
                    generation = d.status()["generation"]
                    inject.kill_worker(head.address)
                    d.wait_generation(generation + 1)
                    d.wait_standby()
                    if k % every == 0:
                        print(k, window(head), flush=True)
                code, _ = d.stop()
                assert code == 0, d.tail()
    finally:
        inject.disconnect()
        head.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
