"""Where the replicas' TTFT tail is: every request of the chat load with its conversation, turn,
start time, TTFT and cached tokens, for `vllm serve --data-parallel-size 2` and the daemon's
`prefix` routing, alternating, the client prioritised as `bench.prefix_routing --client-nice`.

    .venv/bin/python bench/results/replica-ttft-tail-2026-11-28/tailprobe.py --rounds 2 --out DIR
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import openai

from bench import prefix_routing as pr
from bench.common import MODEL_NAME, VllmServe, prioritise
from chaos.harness import Daemon


async def conversation(client, system, seed, args, t0, rows):
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": pr.text(rng, args.user_words)})
        started = time.monotonic()
        first, reply, usage = None, [], None
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.monotonic() - started
                reply.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        details = getattr(usage, "prompt_tokens_details", None)
        rows.append({"conv": seed, "turn": turn, "start_s": round(started - t0, 3), "ttft_ms": round(1000 * first, 1),
                     "prompt": usage.prompt_tokens, "cached": (details.cached_tokens or 0) if details else None,
                     "end_s": round(time.monotonic() - t0, 3)})
        messages.append({"role": "assistant", "content": "".join(reply)})


async def workload(base_url, args):
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    systems = [pr.text(random.Random(1000 + s), args.system_words) for s in range(args.system_prompts)]
    gate = asyncio.Semaphore(args.concurrency)
    rows: list = []
    t0 = time.monotonic()

    async def one(i):
        async with gate:
            await conversation(client, systems[i % len(systems)], i, args, t0, rows)

    await asyncio.gather(*(one(i) for i in range(args.conversations)))
    await client.close()
    return rows


def client_run(base_url, args):
    return asyncio.run(workload(base_url, args))


def session(nice):
    os.setsid()
    prioritise(os.getpid(), nice)


def measure(base_url, args):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=session,
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
