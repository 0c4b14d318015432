"""The CPU one ``/metrics`` scrape costs each server's front (its API server process; the daemon's
process), after a warm-up load so the histograms hold data. ``bench.serving_overhead`` read one
scrape inside its CPU window until 2026-11-29; this says what that added.

    PYTHONPATH=. .venv/bin/python bench/results/metrics-scrape-2026-11-29/scrape.py [SCRAPES]
"""

import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import cpu_s
from bench.serving_overhead import ProbeLoad, warm_server
from chaos.harness import RayHead


def main() -> None:
    scrapes = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    work = Path(tempfile.mkdtemp(prefix="scrape-"))
    head = RayHead(num_cpus=2).start()
    try:
        for kind in ("vllm_serve", "daemon", "vllm_serve", "daemon"):
            (work / kind).mkdir(exist_ok=True)
            with warm_server(kind, work / kind, head, kind, ProbeLoad) as server:
                time.sleep(3)
                pid = server.proc.pid
                idle0 = cpu_s(pid)
                time.sleep(5)
                idle = (cpu_s(pid) - idle0) / 5  # the front's own idle CPU per second
                before, t0 = cpu_s(pid), time.monotonic()
                size = 0
                for _ in range(scrapes):
                    size = len(httpx.get(f"{server.base_url}/metrics", timeout=30).content)
                took = time.monotonic() - t0
                spent = cpu_s(pid) - before - idle * took
                print(f"{kind}: {1000 * spent / scrapes:.1f} CPU-ms per scrape ({scrapes} scrapes, {size} bytes, "
                      f"{1000 * took / scrapes:.1f} ms each by the wall; idle {100 * idle:.2f} % taken out)", flush=True)
    finally:
        head.stop()


if __name__ == "__main__":
    main()
