"""The daemon's own code in a real front, sized without a tracing profiler's inflation: py-spy
samples the front's main thread (``--nonblocking``, 250 Hz, Python frames) during a saturation
load (1200 prompts, 8 at a time, 32 in / 64 out), for ``vllm serve`` and the daemon, in
alternating rounds. A sample's own frame (the innermost) in ``supervisor/``, ``health/`` or
``executor/`` is the daemon's own code; its share of the thread's samples times the thread's CPU
per token (``/proc`` schedstat over the same load) is that code's CPU per token.

    PYTHONPATH=. .venv/bin/python bench/results/front-sampled-2026-11-29/sample.py [rounds]
"""

import collections
import subprocess
import sys
from pathlib import Path

from bench.common import bench_serve, thread_schedstat
from bench.serving_overhead import ProbeLoad, warm_rounds

PY_SPY = Path(sys.executable).parent / "py-spy"
OURS = ("(supervisor/", "(health/", "(executor/")  # py-spy names a file by its path under sys.path


def shares(raw: Path) -> tuple[int, collections.Counter]:
    """(the main thread's samples, samples by own frame's group) from py-spy's raw output: one
    line per stack, outermost frame first, its count last. Other threads' stacks start at
    ``Thread._bootstrap``; the main thread's at the module or, under the event loop, at a task."""
    total, groups = 0, collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if frames[0].startswith("Thread._bootstrap"):
            continue
        leaf, n = frames[-1], int(count)
        total += n
        groups["ours" if any(k in leaf for k in OURS) else "vllm" if "(vllm/" in leaf else "other"] += n
        if any(k in f for f in frames for k in OURS):
            groups["with ours on the stack"] += n
    return total, groups


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    kinds = ["vllm_serve", "daemon"]
    for r, kind, server, work, _ in warm_rounds(kinds, rounds, "front-sampled-", ProbeLoad):
        raw = work / "py-spy.raw"
        pid = server.proc.pid
        before = thread_schedstat(pid)
        spy = subprocess.Popen([str(PY_SPY), "record", "--nonblocking", "-r", "250", "-d", "15", "-f", "raw",
                                "-o", str(raw), "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            result = bench_serve(server.base_url, work, f"{kind}-{r}", 1200, float("inf"), 32, 64,
                                 max_concurrency=8, client_nice=-10)
        finally:
            spy.wait(60)
        after = thread_schedstat(pid)
        tokens = result["total_output_tokens"]
        loop_us = 1e6 * (after[0] - before[0]) / tokens
        total, groups = shares(raw)
        ours = groups["ours"] / max(1, total)
        print(f"round {r + 1} {kind}: {result['request_throughput']:.1f} req/s; loop {loop_us:.1f} µs/token; "
              f"{total} samples: own frame in the daemon's code {100 * ours:.1f} % (≈ {ours * loop_us:.1f} µs/token), "
              f"in vllm {100 * groups['vllm'] / max(1, total):.1f} %, elsewhere {100 * groups['other'] / max(1, total):.1f} %; "
              f"the daemon's code on the stack {100 * groups['with ours on the stack'] / max(1, total):.1f} %", flush=True)
        (Path(__file__).parent / f"{kind}-{r}.raw").write_text(raw.read_text())


if __name__ == "__main__":
    main()
