"""Is the front's extra CPU per token the daemon's code, or where the kernel runs its loop? The
front's event-loop thread alone (``sched_setaffinity`` of the main thread's tid, not the
process) is pinned to one core, the same for both servers, and its CPU per output token read
(``/proc`` schedstat) over a saturation load (2000 prompts, 8 at a time, 32 in / 64 out), in
alternating rounds. A watcher counted where the kernel put it unpinned
(``bench/results/front-cores-2026-11-29/``).

    PYTHONPATH=. .venv/bin/python bench/results/front-pinned-2026-11-29/pinned.py [rounds] [core]
"""

import os
import sys

from bench.common import bench_serve, thread_schedstat
from bench.serving_overhead import ProbeLoad, warm_rounds


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    core = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    for r, kind, server, work, _ in warm_rounds(["vllm_serve", "daemon"], rounds, "front-pinned-", ProbeLoad):
        pid = server.proc.pid
        os.sched_setaffinity(pid, {core})  # the thread whose tid is pid: the event loop
        before = thread_schedstat(pid)
        result = bench_serve(server.base_url, work, f"{kind}-{r}", 2000, float("inf"), 32, 64,
                             max_concurrency=8, client_nice=-10)
        run, wait, runs = (b - a for a, b in zip(before, thread_schedstat(pid)))
        tokens = result["total_output_tokens"]
        print(f"round {r + 1} {kind} (loop on core {core}): {result['request_throughput']:.1f} req/s, "
              f"loop {1e6 * run / tokens:.1f} µs/token on a core, {1e6 * wait / tokens:.1f} waiting, "
              f"{runs / tokens:.2f} runs/token", flush=True)


if __name__ == "__main__":
    main()
