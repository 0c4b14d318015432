"""Where the front's event loop spends its time per token, by function, in ``vllm serve`` and the
daemon: py-spy samples the front's main thread (``--nonblocking``, 250 Hz, Python frames) over
a whole saturation load (3000 prompts, 8 at a time, 32 in / 64 out), in alternating rounds,
beside the thread's own clock (``/proc`` schedstat: time on a core, time waiting for one).

A sample is taken whenever the thread is runnable (on a core or waiting for one), so a
function's samples per token, over 250 Hz, are its time runnable per token; the thread's
share on a core (run / (run + wait)) turns that into CPU per token, assuming the wait falls
evenly. ``analyse.py`` compares the servers function by function, inclusive of callees.

    PYTHONPATH=. .venv/bin/python bench/results/front-sampled-long-2026-11-29/sample.py [rounds]
"""

import gzip
import json
import subprocess
import sys
from pathlib import Path

from bench.common import bench_serve, thread_schedstat
from bench.serving_overhead import ProbeLoad, warm_rounds

PY_SPY = Path(sys.executable).parent / "py-spy"
HERE = Path(__file__).parent
PROMPTS = 3000


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for r, kind, server, work, _ in warm_rounds(["vllm_serve", "daemon"], rounds, "front-sampled-long-", ProbeLoad):
        raw = work / "py-spy.raw"
        pid = server.proc.pid
        spy = subprocess.Popen([str(PY_SPY), "record", "--nonblocking", "-r", "250", "-d", "600", "-f", "raw",
                                "-o", str(raw), "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before = thread_schedstat(pid)
        try:
            result = bench_serve(server.base_url, work, f"{kind}-{r}", PROMPTS, float("inf"), 32, 64,
                                 max_concurrency=8, client_nice=-10)
        finally:
            after = thread_schedstat(pid)
            spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
            spy.wait(60)
        run_s, wait_s, runs = (b - a for a, b in zip(before, after))
        tokens = result["total_output_tokens"]
        info = {"kind": kind, "round": r + 1, "tokens": tokens, "req_s": result["request_throughput"],
                "loop_run_s": run_s, "loop_wait_s": wait_s, "loop_runs": runs}
        print(json.dumps(info), flush=True)
        (HERE / f"{kind}-{r}.json").write_text(json.dumps(info))
        (HERE / f"{kind}-{r}.raw.gz").write_bytes(gzip.compress(raw.read_bytes(), 9))


if __name__ == "__main__":
    main()
