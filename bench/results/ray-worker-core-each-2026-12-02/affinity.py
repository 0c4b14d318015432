"""Where each thread of a Ray V2 replica's worker may run, and ran, under the chat load (issue 42,
2026-12-03): the defaults (workers adopted from the warm standby) against ``standby = "none"``
(workers vLLM's executor made), both with a core each (``VLLM_CPU_OMP_THREADS_BIND=0|1``).

Per daemon, once serving and again in the middle of a load (``bench.prefix_routing``'s, as in
``coreprobe_each.py``): for every process of the tree that is a worker or an engine core, each thread's
allowed CPUs (``Cpus_allowed_list``) and the CPU it last ran on (``/proc/…/stat`` field 39), grouped.

    PYTHONPATH=. .venv/bin/python bench/results/ray-worker-core-each-2026-12-02/affinity.py [KIND ...]
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import coreprobe_each as ce  # noqa: E402
from coreprobe_each import pr, tp  # noqa: E402

from executor import procfs  # noqa: E402

NAMES = ("StandbyRay", "Supervised", "EngineCor", "VLLM::Worker", "vllm-supervisor")


def snapshot(root: int) -> None:
    for pid in tp.named(root, NAMES):
        comm = (procfs.read(pid, "comm") or b"?").decode().strip()
        groups: collections.Counter = collections.Counter()
        for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
            # a thread's own /proc/<tid> holds its comm, status and stat
            name, status, fields = procfs.read(tid, "comm"), procfs.read(tid, "status"), procfs.stat(tid)
            if not (name and status and fields):
                continue  # the thread ended
            name = name.decode().strip()
            allowed = next(line.split()[1].decode() for line in status.splitlines() if line.startswith(b"Cpus_allowed_list"))
            last = fields[36].decode()  # /proc/<pid>/stat field 39: the CPU it last ran on
            groups[(name if not name.startswith(("ray::", "VLLM::", "python")) else "<main>", allowed, last)] += 1
        busy = sorted(((n, a, c), k) for (n, a, c), k in groups.items())
        print(f"  {comm}@{pid}: " + "; ".join(f"{n} allowed {a} last {c} x{k}" for (n, a, c), k in busy), flush=True)


def one(kind: str) -> None:
    args = pr.workload_parser().parse_args(["--client-nice", "-10", "--conversations", "64"])
    with ce.serving(kind) as d:
        print(f"{kind}, at rest:", flush=True)
        snapshot(d.proc.pid)
        load = threading.Thread(target=pr.measure, args=(d.base_url, args))
        load.start()
        time.sleep(8)
        print(f"{kind}, under load:", flush=True)
        snapshot(d.proc.pid)
        load.join()


if __name__ == "__main__":
    for k in sys.argv[1:] or [pr.PREFIX_CORE_EACH, ce.NO_STANDBY]:
        one(k)
