"""How much of the front's extra CPU per token is the daemon's stream path? Three servers in
alternating rounds, each loaded at saturation (2000 prompts, 8 at a time, 32 in / 64 out), the
front's event-loop thread's CPU per output token read from ``/proc`` schedstat: ``vllm serve``,
the daemon (``standby = "none"``), and the same daemon with its stream path cut to vLLM's own
(``site/sitecustomize.py``, on ``PYTHONPATH`` for that daemon only: ``Streams.run`` returns the
engine's ``generate``). What is left in the thin daemon is its process: its HTTP layer, its
background tasks, its imports and heap.

    PYTHONPATH=. .venv/bin/python bench/results/front-thin-2026-11-29/thin.py [rounds]
"""

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.common import RayHead, bench_serve, start_daemon, thread_schedstat
from bench.serving_overhead import ProbeLoad, alternating, start, warm_up

HERE = Path(__file__).parent
KINDS = ["vllm_serve", "daemon_standby_none", "daemon_thin"]


def launch(kind: str, work: Path, head: RayHead):
    if kind != "daemon_thin":
        return start(kind, work, head)
    path = os.pathsep.join([str(HERE / "site"), str(HERE.parents[2])])
    server = start_daemon(work, head, env={"PYTHONPATH": path}, standby="none")
    server.wait_ready()
    return server


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    work = Path(tempfile.mkdtemp(prefix="front-thin-"))
    head = RayHead(num_cpus=2).start()
    try:
        for r, kind in alternating(KINDS, rounds):
            (work / f"{kind}-{r}").mkdir()
            server = launch(kind, work / f"{kind}-{r}", head)
            try:
                warm_up(server, work / f"{kind}-{r}", f"{kind}-{r}", ProbeLoad)
                pid = server.proc.pid
                before = thread_schedstat(pid)
                result = bench_serve(server.base_url, work / f"{kind}-{r}", f"{kind}-{r}", 2000, float("inf"), 32, 64,
                                     max_concurrency=8, client_nice=-10)
                run, wait, runs = (b - a for a, b in zip(before, thread_schedstat(pid)))
                tokens = result["total_output_tokens"]
                thin = ""
                if kind == "daemon_thin":
                    log = next((work / f"{kind}-{r}").rglob("daemon.log"), None)
                    with contextlib.suppress(OSError):
                        thin = " (thin: " + str("front-thin probe" in (log.read_text() if log else "")) + ")"
                print(f"round {r + 1} {kind}{thin}: {result['request_throughput']:.1f} req/s, loop {1e6 * run / tokens:.1f} "
                      f"µs/token on a core, {1e6 * wait / tokens:.1f} waiting, {runs / tokens:.2f} runs/token", flush=True)
            finally:
                server.stop()
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
