"""What a Prometheus scrape does to the streams: the daemon (its own Ray, the demo model), 4
streams of 300 tokens at once, with and without /metrics scraped every 0.1 s; the largest gap
between a stream's chunks and the p99 gap, and the scrape's latency. python scrape_stall.py LABEL ROUNDS"""
import asyncio, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "/work/main")
import httpx
from chaos.harness import Daemon

label, rounds = sys.argv[1], int(sys.argv[2])

async def stream(client, gaps):
    last = None
    async with client.stream("POST", "/v1/completions", json={"model": "demo-tiny-llama", "prompt": "hello there",
            "max_tokens": 300, "stream": True, "ignore_eos": True, "temperature": 0}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now

async def scraper(client, stop, lat):
    while not stop.is_set():
        t = time.monotonic()
        r = await client.get("/metrics")
        assert r.status_code == 200
        lat.append(time.monotonic() - t)
        await asyncio.sleep(0.1)

async def load(base, scrape):
    gaps, lat = [], []
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        stop = asyncio.Event()
        s = asyncio.create_task(scraper(client, stop, lat)) if scrape else None
        await asyncio.gather(*(stream(client, gaps) for _ in range(4)))
        stop.set()
        if s: await s
    gaps.sort()
    return {"max_gap_ms": 1000 * gaps[-1], "p99_gap_ms": 1000 * gaps[int(0.99 * len(gaps))], "p50_gap_ms": 1000 * statistics.median(gaps),
            "scrapes": len(lat), "scrape_ms_median": 1000 * statistics.median(lat) if lat else None}

work = Path(tempfile.mkdtemp(prefix="scrape-"))
with Daemon(work, {"engine": {"max_model_len": 1024}, "ray": {"address": ""}, "supervisor": {"standby": "none"}},
            args=("--disable-uvicorn-access-log",), own_session=True).start() as d:
    d.wait_ready()
    asyncio.run(load(d.base_url, False))  # warm
    for r in range(rounds):
        for scrape in (False, True) if r % 2 == 0 else (True, False):
            res = asyncio.run(load(d.base_url, scrape))
            print(label, r, "scraped" if scrape else "quiet", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
    code, _ = d.stop()
    assert code == 0
