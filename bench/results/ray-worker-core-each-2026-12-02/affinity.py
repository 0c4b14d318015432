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
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-step-2026-11-29"))
sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-step-2026-11-28"))
import threadprobe2 as tp  # noqa: E402

from bench import prefix_routing as pr  # noqa: E402
from chaos.harness import Daemon  # noqa: E402
from executor import procfs  # noqa: E402

NAMES = ("StandbyRay", "Supervised", "EngineCor", "VLLM::Worker", "vllm-supervisor")


def snapshot(root: int) -> None:
    for pid in tp.named(root, NAMES):
        comm = (procfs.read(pid, "comm") or b"?").decode().strip()
        groups: collections.Counter = collections.Counter()
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
                allowed = next(line.split()[1] for line in (task / "status").read_text().splitlines()
                               if line.startswith("Cpus_allowed_list"))
                last = (task / "stat").read_text().rsplit(")", 1)[1].split()[36]
            except (OSError, StopIteration, IndexError):
                continue
            groups[(name if not name.startswith(("ray::", "VLLM::", "python")) else "<main>", allowed, last)] += 1
        busy = sorted(((n, a, c), k) for (n, a, c), k in groups.items())
        print(f"  {comm}@{pid}: " + "; ".join(f"{n} allowed {a} last {c} x{k}" for (n, a, c), k in busy), flush=True)


def one(kind: str) -> None:
    config, flags = pr.daemon_setup(pr.PREFIX_CORE_EACH)
    if kind == "prefix_core_each_no_standby":
        config["supervisor"]["standby"] = "none"
    args = pr.workload_parser().parse_args(["--client-nice", "-10", "--conversations", "64"])
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), config, args=flags, env=dict(pr.CORE_EACH_ENV),
                                                      own_session=True).start() as d:
        d.wait_ready(); d.wait_replicas_serving()
        if kind != "prefix_core_each_no_standby":
            d.wait_standby()
        print(f"{kind}, at rest:", flush=True)
        snapshot(d.proc.pid)
        load = threading.Thread(target=pr.measure, args=(d.base_url, args))
        load.start()
        time.sleep(8)
        print(f"{kind}, under load:", flush=True)
        snapshot(d.proc.pid)
        load.join()
        d.stop()


if __name__ == "__main__":
    for k in sys.argv[1:] or ["prefix_core_each", "prefix_core_each_no_standby"]:
        one(k)
