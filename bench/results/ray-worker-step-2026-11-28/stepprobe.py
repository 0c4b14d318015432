"""Where a slow replica's time goes under `bench.prefix_routing`'s chat load (client at -10): the
daemon's 2 replicas on Ray V2 (`prefix`) and on `mp` (`prefix_mp`), alternating; per kind, the
load's took, vLLM's own histograms summed over both engines (TTFT, queue, prefill, inter-token
latency: the mean gap between a request's tokens, about one engine step), and each worker's and
engine core's main thread's CPU and run-queue wait (`/proc/<pid>/task/<pid>/schedstat`).

    PYTHONPATH=. .venv/bin/python bench/results/ray-worker-step-2026-11-28/stepprobe.py ROUNDS

(steps.log was made with a copy of the daemon's config and flags, the same as
``bench.prefix_routing.daemon_setup`` gives, which it now calls.)
"""
from __future__ import annotations

import re
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench import prefix_routing as pr
from bench.common import tree
from chaos.harness import Daemon

HISTS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
         "vllm:request_prefill_time_seconds", "vllm:inter_token_latency_seconds")


def hists(base_url):
    text = urllib.request.urlopen(base_url + "/metrics").read().decode()
    out = {}
    for h in HISTS:
        for part in ("sum", "count"):
            out[(h, part)] = sum(float(v) for v in re.findall(r'^' + re.escape(h) + "_" + part + r'\{[^}]*\} ([0-9.e+-]+)', text, re.M))
    return out


def mains(root):
    """Each worker's and engine core's main thread: (name, CPU s, run-queue wait s)."""
    out = {}
    for pid in tree(root):
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
            if not any(k in name for k in ("Worker", "StandbyRay", "Supervised", "EngineCor")):
                continue
            run, wait, _ = map(int, open(f"/proc/{pid}/task/{pid}/schedstat").read().split())
        except (OSError, ValueError):
            continue
        out[pid] = (name, run / 1e9, wait / 1e9)
    return out


def one(kind, args):
    config, flags = pr.daemon_setup(kind)
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), config, args=flags, own_session=True).start() as d:
        d.wait_ready(); d.wait_replicas_serving(); d.wait_standby()
        h0, t0 = hists(d.base_url), mains(d.proc.pid)
        row = pr.measure(d.base_url, args)
        h1, t1 = hists(d.base_url), mains(d.proc.pid)
        mean = {h.split(":")[1].replace("_seconds", ""): 1000 * (h1[(h, "sum")] - h0[(h, "sum")]) / max(1, h1[(h, "count")] - h0[(h, "count")])
                for h in HISTS}
        print(f"{kind}: took {row['took_s']} s, TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms; vLLM means (ms): "
              + ", ".join(f"{k} {v:.1f}" for k, v in mean.items()), flush=True)
        for pid, (name, run, wait) in sorted(t1.items()):
            if pid in t0:
                print(f"    {name}@{pid}: main thread CPU {run - t0[pid][1]:.2f} s, waiting for a core {wait - t0[pid][2]:.2f} s", flush=True)
        d.stop()


def main():
    args = pr.workload_parser().parse_args(["--client-nice", "-10"])
    kinds = ["prefix", pr.PREFIX_MP]
    for r in range(int(sys.argv[1])):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            one(kind, args)


if __name__ == "__main__":
    main()
