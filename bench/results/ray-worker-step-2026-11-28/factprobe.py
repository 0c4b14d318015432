"""What a replica's worker process runs with, per server: its niceness, each thread's CPU
affinity, the OpenMP and preload variables in its environment, and the OpenMP and allocator
libraries mapped into it, for `vllm serve --data-parallel-size 2` and the daemon's 2 replicas on
Ray V2 and on `mp`, after one chat request.

    PYTHONPATH=. .venv/bin/python bench/results/ray-worker-step-2026-11-28/factprobe.py vllm prefix prefix_mp
"""
from __future__ import annotations

import asyncio
import collections
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "replica-ttft-tail-2026-11-28"))
import firstprobe  # noqa: E402
import openai  # noqa: E402

from bench.common import VllmServe, tree  # noqa: E402
from chaos.harness import Daemon  # noqa: E402

KEYS = ("OMP", "KMP", "GOMP", "LD_PRELOAD", "MALLOC", "VLLM_CPU", "TORCH", "MKL", "LOCAL_WORLD", "CUDA_VISIBLE")


def describe(pid):
    comm = open(f"/proc/{pid}/comm").read().strip()
    nice = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])
    env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
    aff = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/task/{tid}/status"))
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except OSError:
            continue
        aff[(name.split("/")[0].rstrip("0123456789"), status["Cpus_allowed_list"].strip())] += 1
    libs = sorted({line.split()[-1] for line in open(f"/proc/{pid}/maps")
                   if any(k in line for k in ("gomp", "iomp", "libomp", "tcmalloc", "jemalloc"))})
    print(f"{comm}@{pid} nice {nice}")
    print("   env:", {k: v for k, v in sorted(env.items()) if k.startswith(KEYS)})
    print("   libs:", libs)
    print("   threads (name, cpus): count:", dict(aff))


def report(root):
    for pid in tree(root):
        try:
            comm = open(f"/proc/{pid}/comm").read()
            if any(k in comm for k in ("Worker", "StandbyRay", "Supervised", "EngineCor", "RayWorker")):
                describe(pid)
        except OSError:
            pass


async def ask(base_url):
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    await firstprobe.one(client, 1)
    await client.close()


def main():
    for kind in sys.argv[1:]:
        print("==", kind, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            if kind == "vllm":
                server = VllmServe(Path(tmp), None, extra=("--data-parallel-size", "2")).start()
                try:
                    server.wait_ready()
                    asyncio.run(ask(server.base_url))
                    report(server.proc.pid)
                finally:
                    server.stop()
                continue
            flags = ("--data-parallel-size", "2", *(("--distributed-executor-backend", "mp") if kind == "prefix_mp" else ()))
            config = {"engine": {"max_model_len": 1024}, "ray": {"address": ""}, "supervisor": {"routing": "prefix"}}
            with Daemon(Path(tmp), config, args=flags, own_session=True).start() as daemon:
                daemon.wait_ready(); daemon.wait_replicas_serving()
                asyncio.run(ask(daemon.base_url))
                report(daemon.proc.pid)
                daemon.stop()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
