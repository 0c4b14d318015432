"""The first requests a fresh server answers: TTFT of 6 single chat requests one after the
other (each its own system prompt, ~330 prompt tokens), then of a batch of 8 at once, on
`vllm serve --data-parallel-size 2` and on the daemon (`prefix`), the client prioritised.

    PYTHONPATH=. .venv/bin/python bench/results/replica-ttft-tail-2026-11-28/firstprobe.py KIND...
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import openai

from bench import prefix_routing as pr
from bench.common import MODEL_NAME, VllmServe, prioritise
from chaos.harness import Daemon


async def one(client, seed):
    rng = random.Random(seed)
    messages = [{"role": "system", "content": pr.text(rng, 60)}, {"role": "user", "content": pr.text(rng, 12)}]
    started = time.monotonic()
    first = None
    stream = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - started
    return round(1000 * first, 1)


async def probe(base_url):
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    singles = [await one(client, 100 + i) for i in range(6)]
    batch1 = await asyncio.gather(*(one(client, 200 + i) for i in range(8)))
    batch2 = await asyncio.gather(*(one(client, 300 + i) for i in range(8)))
    await client.close()
    return singles, sorted(batch1), sorted(batch2)


def client_run(base_url):
    return asyncio.run(probe(base_url))


def session(nice):
    os.setsid()
    prioritise(os.getpid(), nice)


def run_client(base_url):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=session,
                             initargs=(-10,)) as pool:
        return pool.submit(client_run, base_url).result(timeout=900)


def main():
    for kind in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if kind == "prefix":
                config = {"engine": {"max_model_len": 1024}, "ray": {"address": ""}, "supervisor": {"routing": "prefix"}}
                flags = ("--data-parallel-size", "2", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log")
                with Daemon(work, config, args=flags, own_session=True).start() as daemon:
                    daemon.wait_ready(); daemon.wait_replicas_serving(); daemon.wait_standby()
                    out = run_client(daemon.base_url)
                    daemon.stop()
            else:
                server = VllmServe(work, None, extra=("--data-parallel-size", "2", "--enable-prompt-tokens-details"))
                server.start()
                try:
                    server.wait_ready()
                    out = run_client(server.base_url)
                finally:
                    server.stop()
            print(kind, "singles", out[0], "batch1", out[1], "batch2", out[2], flush=True)


if __name__ == "__main__":
    main()
