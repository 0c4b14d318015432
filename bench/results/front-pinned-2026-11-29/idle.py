"""The front's event-loop thread idle: its CPU per second over 30 s with no request (after the
warm-up load), in ``vllm serve`` and the daemon, alternating rounds: what the daemon's own
tasks on the loop (the probe's stall check, the cluster watch, the standby's poll, the canary)
cost per second, to set beside the loop's extra per token under load.

    PYTHONPATH=. .venv/bin/python bench/results/front-pinned-2026-11-29/idle.py [rounds]
"""

import sys
import time

from bench.common import thread_schedstat
from bench.serving_overhead import ProbeLoad, warm_rounds

WINDOW_S = 30.0


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for r, kind, server, work, _ in warm_rounds(["vllm_serve", "daemon"], rounds, "front-idle-", ProbeLoad):
        pid = server.proc.pid
        time.sleep(5)
        before = thread_schedstat(pid)
        time.sleep(WINDOW_S)
        run, wait, runs = (b - a for a, b in zip(before, thread_schedstat(pid)))
        print(f"round {r + 1} {kind}: the loop idle, {1e3 * run / WINDOW_S:.2f} ms on a core per second, "
              f"{runs / WINDOW_S:.1f} wake-ups per second", flush=True)


if __name__ == "__main__":
    main()
