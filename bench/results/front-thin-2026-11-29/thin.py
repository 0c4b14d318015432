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

from bench.common import RayHead, start_daemon
from bench.serving_overhead import ProbeLoad, alternating, loop_load, start, warm_up

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
                measured = loop_load(server, work / f"{kind}-{r}", f"{kind}-{r}")
                thin = ""
                if kind == "daemon_thin":
                    log = next((work / f"{kind}-{r}").rglob("daemon.log"), None)
                    with contextlib.suppress(OSError):
                        thin = " (thin: " + str("front-thin probe" in (log.read_text() if log else "")) + ")"
                print(f"round {r + 1} {kind}{thin}: {measured}", flush=True)
            finally:
                server.stop()
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
