"""(run.log and the JSON files were made by this probe as of 05ee66c, which copied
``bench.prefix_routing``'s conversation loop; it now reads that loop's own per-request rows.)

Where the replicas' TTFT tail is: every request of the chat load with its conversation, turn,
start time, TTFT and cached tokens, for `vllm serve --data-parallel-size 2` and the daemon's
`prefix` routing, alternating, the client prioritised as `bench.prefix_routing --client-nice`.

    .venv/bin/python bench/results/replica-ttft-tail-2026-11-28/tailprobe.py --rounds 2 --out DIR
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench import prefix_routing as pr
from bench.common import VllmServe
from chaos.harness import Daemon


async def workload(base_url, args):
    """``bench.prefix_routing``'s chat load, each request with its conversation, turn, start and end
    (seconds from the first request's start), TTFT and cached tokens."""
    rows = await pr.workload(base_url, args)
    t0 = min(r["started"] for r in rows)
    return [{"conv": r["conversation"], "turn": r["turn"], "start_s": round(r["started"] - t0, 3),
             "ttft_ms": round(1000 * r["ttft_s"], 1), "prompt": r["prompt_tokens"], "cached": r["cached_tokens"],
             "end_s": round(r["ended"] - t0, 3)} for r in rows]


def client_run(base_url, args):
    return asyncio.run(workload(base_url, args))


def measure(base_url, args):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=pr._client_session,
                             initargs=(-10,)) as pool:
        return pool.submit(client_run, base_url, args).result(timeout=900)


def main():
    parser = pr.workload_parser()
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in (args.kinds if r % 2 == 0 else args.kinds[::-1]):
                work = Path(tmp) / f"{kind}-{r}"
                work.mkdir()
                if kind == "prefix":
                    config = {"engine": {"max_model_len": 1024}, "ray": {"address": ""}, "supervisor": {"routing": "prefix"}}
                    flags = ("--data-parallel-size", "2", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log")
                    with Daemon(work, config, args=flags, own_session=True).start() as daemon:
                        daemon.wait_ready(); daemon.wait_replicas_serving(); daemon.wait_standby()
                        rows = measure(daemon.base_url, args)
                        code, _ = daemon.stop()
                else:
                    server = VllmServe(work, None, extra=("--data-parallel-size", "2", "--enable-prompt-tokens-details"))
                    server.start()
                    try:
                        server.wait_ready()
                        rows = measure(server.base_url, args)
                    finally:
                        server.stop()
                (args.out / f"{kind}-{r + 1}.json").write_text(json.dumps(rows) + "\n")
                ttft = sorted(x["ttft_ms"] for x in rows)
                print(kind, r + 1, "took", max(x["end_s"] for x in rows), "p50", ttft[len(ttft) // 2], "p99", ttft[int(0.99 * len(ttft))], flush=True)
                for x in sorted(rows, key=lambda x: -x["ttft_ms"])[:8]:
                    print("   ", x, flush=True)


if __name__ == "__main__":
    main()
