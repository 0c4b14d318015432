"""A burst of 8 chat requests at once on the daemon's 2 replicas: where each went (vLLM's
per-engine request counters before and after) and its TTFT, three bursts.

    PYTHONPATH=. .venv/bin/python bench/results/replica-ttft-tail-2026-11-28/burstprobe.py
"""
from __future__ import annotations

import asyncio
import re
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import firstprobe  # noqa: E402
import openai  # noqa: E402

from chaos.harness import Daemon  # noqa: E402


HISTS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")


def counts(base_url):
    """Requests per engine, and the sums of vLLM's own TTFT, queue and prefill histograms."""
    text = urllib.request.urlopen(base_url + "/metrics").read().decode()
    out = {}
    for m in re.finditer(r'^vllm:request_success_total\{([^}]*)\} ([0-9.e+]+)', text, re.M):
        engine = re.search(r'engine="([^"]*)"', m.group(1)).group(1)
        out[engine] = out.get(engine, 0) + float(m.group(2))
    for h in HISTS:
        out[h] = sum(float(v) for v in re.findall(r'^' + re.escape(h) + r'_sum\{[^}]*\} ([0-9.e+-]+)', text, re.M))
    return out


def delta(after, before):
    return {k: round(after[k] - before.get(k, 0), 3) for k in after}


def cpu_by_name(root):
    from bench.common import tree, tree_cpu_s
    out = {}
    for pid, cpu in tree_cpu_s(tree(root)).items():
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        out[f"{name}@{pid}"] = cpu
    return out


ROOT_PID = None


async def bursts(base_url, root):
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for i in range(4):
        await firstprobe.one(client, 100 + i)
    rows = []
    for b in range(3):
        before, cpu0 = counts(base_url), cpu_by_name(root)
        ttft = await asyncio.gather(*(firstprobe.one(client, 400 + 10 * b + i) for i in range(8)))
        after, cpu1 = counts(base_url), cpu_by_name(root)
        cpu = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1 if k in cpu0 and cpu1[k] - cpu0[k] >= 0.02}
        rows.append((sorted(ttft), round(sum(ttft) / 1000, 3), delta(after, before), cpu))
        await asyncio.sleep(1)
    await client.close()
    return rows


def client_bursts(base_url, root):
    return asyncio.run(bursts(base_url, root))


def run_client(base_url, root):
    """The bursts from a client in a session of its own at niceness -10 (``firstprobe.session``)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=firstprobe.session,
                             initargs=(-10,)) as pool:
        return pool.submit(client_bursts, base_url, root).result(timeout=900)


def main():
    if sys.argv[1:] == ["vllm"]:
        from bench.common import VllmServe
        with tempfile.TemporaryDirectory() as tmp:
            server = VllmServe(Path(tmp), None, extra=("--data-parallel-size", "2"))
            server.start()
            try:
                server.wait_ready()
                for row in run_client(server.base_url, server.proc.pid):
                    print(row, flush=True)
            finally:
                server.stop()
        return
    with tempfile.TemporaryDirectory() as tmp:
        config = {"engine": {"max_model_len": 1024}, "ray": {"address": ""}, "supervisor": {"routing": sys.argv[1] if len(sys.argv) > 1 else "prefix"}}
        for item in filter(None, __import__("os").environ.get("BURST_SUPERVISOR", "").split(",")):  # e.g. standby=none
            key, value = item.split("=", 1)
            config["supervisor"][key] = value
        flags = ("--data-parallel-size", "2", "--disable-uvicorn-access-log", *sys.argv[2:])
        with Daemon(Path(tmp), config, args=flags, own_session=True).start() as daemon:
            daemon.wait_ready(); daemon.wait_replicas_serving()
            if config["supervisor"].get("standby") != "none":
                daemon.wait_standby()
            for row in run_client(daemon.base_url, daemon.proc.pid):
                print(row, flush=True)
            print(daemon.status().get("routing"))
            daemon.stop()


if __name__ == "__main__":
    main()
