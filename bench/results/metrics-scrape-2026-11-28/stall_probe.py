"""Where a stream's multi-second stalls come from: the daemon (its own Ray, standby none), 4
streams of 300 tokens at once, several loads; the client's own event-loop lag (a 5 ms ticker)
beside the largest gap between a stream's chunks, and whether the daemon's front was busy
(its CPU ticks) during that gap, and this client's main thread's run and run-queue wait then. python stall_probe.py LOADS"""
import asyncio, os, sys, tempfile, threading, time
from pathlib import Path
sys.path.insert(0, "/work/main")
import httpx
from chaos.harness import Daemon

def ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])

async def stream(client, arrivals):
    async with client.stream("POST", "/v1/completions", json={"model": "demo-tiny-llama", "prompt": "hello there",
            "max_tokens": 300, "stream": True, "ignore_eos": True, "temperature": 0}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic())

async def load(base, pid):
    arrivals, lags, cpu = [], [], []
    stop = False
    async def ticker():
        last = time.monotonic()
        while not stop:
            await asyncio.sleep(0.005)
            now = time.monotonic(); lags.append((now, now - last - 0.005)); last = now
    main_tid = threading.get_native_id()
    def sampler():  # the front's CPU and this client's run-queue wait every 50 ms, from a thread
        while not stop:
            run_ns, wait_ns, _ = map(int, open(f"/proc/self/task/{main_tid}/schedstat").read().split())
            cpu.append((time.monotonic(), ticks(pid), run_ns, wait_ns)); time.sleep(0.05)
    th = threading.Thread(target=sampler, daemon=True); th.start()
    t = asyncio.create_task(ticker())
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        per = [[] for _ in range(4)]
        await asyncio.gather(*(stream(client, per[i]) for i in range(4)))
    stop = True; await t; th.join()
    worst = max(((b - a, a, b) for p in per for a, b in zip(p, p[1:])), default=(0, 0, 0))
    gap, a, b = worst
    client_lag = max((l for (ts, l) in lags if a - 0.01 <= ts <= b + 0.01), default=0)
    around = [row for row in cpu if a - 0.06 <= row[0] <= b + 0.06]
    front_ticks = (around[-1][1] - around[0][1]) if len(around) > 1 else None
    client_run = round((around[-1][2] - around[0][2]) / 1e6) if len(around) > 1 else None
    client_wait = round((around[-1][3] - around[0][3]) / 1e6) if len(around) > 1 else None
    return {"worst_gap_ms": round(1000 * gap), "client_loop_lag_in_it_ms": round(1000 * client_lag),
            "front_cpu_ticks_in_it": front_ticks, "client_ran_ms": client_run, "client_runq_wait_ms": client_wait, "gap_s_window": round(b - a, 2),
            "client_max_lag_ms": round(1000 * max(l for _, l in lags))}

work = Path(tempfile.mkdtemp(prefix="stall-"))
with Daemon(work, {"engine": {"max_model_len": 1024}, "ray": {"address": ""}, "supervisor": {"standby": "none"}},
            args=("--disable-uvicorn-access-log",), own_session=True).start() as d:
    d.wait_ready()
    asyncio.run(load(d.base_url, d.proc.pid))
    for i in range(int(sys.argv[1])):
        print(i, asyncio.run(load(d.base_url, d.proc.pid)), flush=True)
    code, _ = d.stop()
    assert code == 0
