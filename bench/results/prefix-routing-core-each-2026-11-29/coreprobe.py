"""Where the Ray V2 replicas' first tokens lose their time with a core each: the daemon's 2 replicas
with ``VLLM_CPU_OMP_THREADS_BIND=0|1`` on Ray V2 (``prefix_core_each``) and on ``mp``
(``prefix_mp_core_each``), alternating, under ``bench.prefix_routing``'s chat load (client at -10).
Per kind: vLLM's own histograms summed over both engines (``stepprobe.hists``: TTFT, queue,
prefill, inter-token latency), and per worker the model's threads (``ray::StandbyRay*`` /
``VLLM::Worker``, the threads bound to the replica's core) summed: CPU and run-queue wait from
each thread's ``schedstat``.

    PYTHONPATH=. .venv/bin/python bench/results/prefix-routing-core-each-2026-11-29/coreprobe.py ROUNDS
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from bench import prefix_routing as pr
from bench.common import tree
from chaos.harness import Daemon

_spec = importlib.util.spec_from_file_location(
    "stepprobe", Path(__file__).resolve().parents[1] / "ray-worker-step-2026-11-28" / "stepprobe.py")
stepprobe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stepprobe)

MODEL_THREADS = ("ray::StandbyRay", "VLLM::Worker", "ray::SupervisedR")


def model_threads(root):
    """Per worker process: (cores, CPU s, run-queue wait s) summed over its model's threads."""
    out = {}
    for pid in tree(root):
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        run = wait = 0.0
        cores = set()
        for tid in tasks:
            try:
                name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                if not name.startswith(MODEL_THREADS):
                    continue
                r, w, _ = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
                cores |= os.sched_getaffinity(int(tid))
            except (OSError, ValueError):
                continue
            run, wait = run + r / 1e9, wait + w / 1e9
        if cores:
            out[pid] = (sorted(cores), run, wait)
    return out


def one(kind, args):
    config, flags = pr.daemon_setup(kind)
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), config, env=dict(pr.CORE_EACH_ENV), args=flags,
                                                      own_session=True).start() as d:
        d.wait_ready(); d.wait_replicas_serving(); d.wait_standby()
        h0, t0 = stepprobe.hists(d.base_url), model_threads(d.proc.pid)
        row = pr.measure(d.base_url, args)
        h1, t1 = stepprobe.hists(d.base_url), model_threads(d.proc.pid)
        mean = {h.split(":")[1].replace("_seconds", ""): 1000 * (h1[(h, "sum")] - h0[(h, "sum")])
                / max(1, h1[(h, "count")] - h0[(h, "count")]) for h in stepprobe.HISTS}
        print(f"{kind}: took {row['took_s']} s, TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms, "
              f"hit rate {100 * row['hit_rate']:.1f} %; vLLM means (ms): "
              + ", ".join(f"{k} {v:.1f}" for k, v in mean.items()), flush=True)
        for pid, (cores, run, wait) in sorted(t1.items()):
            if pid in t0:
                print(f"    worker {pid} on cores {cores}: model threads' CPU {run - t0[pid][1]:.2f} s, "
                      f"waiting for a core {wait - t0[pid][2]:.2f} s", flush=True)
        d.stop()


def main():
    args = pr.workload_parser().parse_args(["--client-nice", "-10"])
    kinds = [pr.PREFIX_CORE_EACH, pr.PREFIX_MP_CORE_EACH]
    for r in range(int(sys.argv[1])):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            one(kind, args)


if __name__ == "__main__":
    main()
