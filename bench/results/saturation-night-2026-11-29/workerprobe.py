"""What the saturation bench's three Ray V2 servers run their one worker with: `vllm serve` on Ray V2,
the daemon with its defaults (warm standby) and with ``standby = "none"``, each started as
``bench.serving_overhead`` starts it on one Ray head, after one completion: the worker's and the
engine core's OpenMP and preload variables, their threads (name, allowed cores: count), and what
each server's log says about asynchronous scheduling and the worker's OpenMP binding.

    PYTHONPATH=. .venv/bin/python bench/results/saturation-night-2026-11-29/workerprobe.py vllm_serve daemon daemon_standby_none
"""
from __future__ import annotations

import collections
import os
import re
import sys
import tempfile
from pathlib import Path

import httpx

from bench import serving_overhead as so
from bench.common import MODEL_NAME, tree
from chaos.harness import RayHead

KEYS = ("OMP", "KMP", "GOMP", "LD_PRELOAD", "VLLM_CPU", "TORCH", "LOCAL_WORLD", "RAY_worker_niceness")
NAMES = ("Worker", "StandbyRay", "EngineCor", "RayWorker", "Supervised")
LOG = re.compile(r"async(hronous)?.?scheduling|OpenMP|OMP_NUM_THREADS|thread binding", re.I)


def describe(pid: int) -> None:
    comm = open(f"/proc/{pid}/comm").read().strip()
    env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
    threads = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/task/{tid}/status"))
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except OSError:
            continue
        threads[(name.split("/")[0].rstrip("0123456789"), status["Cpus_allowed_list"].strip())] += 1
    print(f"  {comm}@{pid}")
    print("    env:", {k: v for k, v in sorted(env.items()) if k.startswith(KEYS)})
    print("    threads (name, cpus): count:", dict(threads))


def main() -> None:
    head = RayHead().start()
    try:
        for kind in sys.argv[1:]:
            print("==", kind, flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                server = so.start(kind, Path(tmp), head)
                try:
                    httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                               json={"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 8}).raise_for_status()
                    for pid in tree(server.proc.pid, head.marker):
                        try:
                            if any(k in open(f"/proc/{pid}/comm").read() for k in NAMES):
                                describe(pid)
                        except OSError:
                            pass
                    seen = []
                    for line in Path(server.log_path).read_text(errors="replace").splitlines():
                        text = re.sub(r"^.*?(INFO|WARNING|DEBUG)\s+\S+\s+\S+\s+", "", line)
                        if LOG.search(line) and text not in seen:
                            seen.append(text)
                    print("    log:", *[s[:240] for s in seen[:8]], sep="\n      ")
                finally:
                    server.stop()
            sys.stdout.flush()
    finally:
        head.stop()


if __name__ == "__main__":
    main()
