"""What a Ray V2 worker does differently in a burst: the daemon's 2 replicas (executor flags as
arguments, e.g. `--distributed-executor-backend mp`), 4 singles then 6 bursts of 8 chat requests
(`burstprobe`), the client at niceness -10; over the bursts, each worker's and engine core's
threads' CPU, run-queue wait and time slices (`/proc/<pid>/task/<tid>/schedstat`), and the
process's page faults (minor, major) and context switches (`/proc/<pid>/stat`, `status`).

    PYTHONPATH=. .venv/bin/python bench/results/replica-ttft-tail-2026-11-28/threadprobe.py [FLAGS...]
"""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import firstprobe  # noqa: E402
import openai  # noqa: E402

from bench.common import tree  # noqa: E402
from chaos.harness import Daemon  # noqa: E402


def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run, wait, slices = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (name, run / 1e9, wait / 1e9, slices)
    return out


def process(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    minflt, majflt = int(fields[7]), int(fields[9])
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return minflt, majflt, int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"])


def snapshot(pids):
    return {pid: (open(f"/proc/{pid}/comm").read().strip(), process(pid), threads(pid)) for pid in pids}


async def bursts(base_url, n):
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for i in range(4):
        await firstprobe.one(client, 100 + i)
    sums = []
    for b in range(n):
        ttft = await asyncio.gather(*(firstprobe.one(client, 400 + 10 * b + i) for i in range(8)))
        sums.append(round(sum(ttft) / 1000, 3))
        await asyncio.sleep(0.5)
    await client.close()
    return sums


def client_bursts(base_url, n):
    return asyncio.run(bursts(base_url, n))


def main():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    flags = ("--data-parallel-size", "2", "--disable-uvicorn-access-log", *sys.argv[1:])
    config = {"engine": {"max_model_len": 1024}, "ray": {"address": ""}, "supervisor": {"routing": "prefix"}}
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), config, args=flags, own_session=True).start() as daemon:
        daemon.wait_ready(); daemon.wait_replicas_serving()
        if "mp" not in sys.argv[1:]:
            daemon.wait_standby()
        pids = [p for p in tree(daemon.proc.pid)
                if any(k in open(f"/proc/{p}/comm").read() for k in ("Worker", "StandbyRay", "Supervised", "EngineCor"))]
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=firstprobe.session,
                                 initargs=(-10,)) as pool:
            before = snapshot(pids)
            sums = pool.submit(client_bursts, daemon.base_url, 6).result(timeout=900)
            after = snapshot(pids)
        print("flags", sys.argv[1:], "TTFT sums per burst", sums, flush=True)
        for pid, (comm, proc1, th1) in after.items():
            comm0, proc0, th0 = before[pid]
            d = [a - b for a, b in zip(proc1, proc0)]
            print(f"{comm}@{pid}: minflt {d[0]} majflt {d[1]} vol-cs {d[2]} invol-cs {d[3]}")
            rows = []
            for tid, (name, run, wait, slices) in th1.items():
                if tid in th0:
                    _, run0, wait0, slices0 = th0[tid]
                    if run - run0 > 0.005 or wait - wait0 > 0.005:
                        rows.append((run - run0, name, tid, wait - wait0, slices - slices0))
            for run, name, tid, wait, slices in sorted(rows, reverse=True):
                print(f"    {name}@{tid}: cpu {run:.3f} s, waiting {wait:.3f} s, slices {slices}")
        daemon.stop()


if __name__ == "__main__":
    main()
