"""The front's event-loop thread over one saturation load (``bench.serving_overhead``'s: 400
prompts, 8 at a time, 32 in / 64 out), split into user and kernel time, with its context switches
(voluntary: it waited, e.g. in ``epoll_wait`` or on the GIL; involuntary: preempted), per output
token, for ``vllm serve``, the daemon and the daemon without the standby, in alternating rounds.
cProfile sees only the Python functions; the kernel's part and the wake-ups are what it cannot see.

    PYTHONPATH=. .venv/bin/python bench/results/front-loop-kernel-2026-11-29/probe.py [rounds]
"""

import os
import sys
from pathlib import Path

from bench.common import bench_serve
from bench.serving_overhead import ProbeLoad, warm_rounds

TICK = os.sysconf("SC_CLK_TCK")


def loop_thread(pid: int) -> tuple[float, float, int, int]:
    """(user s, kernel s, voluntary switches, involuntary switches) of ``pid``'s main thread."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    status = {line.split(":")[0]: line.split()[1] for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines()
              if "ctxt_switches" in line}
    return (int(fields[11]) / TICK, int(fields[12]) / TICK, int(status["voluntary_ctxt_switches"]),
            int(status["nonvoluntary_ctxt_switches"]))


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    kinds = ["vllm_serve", "daemon", "daemon_standby_none"]
    for r, kind, server, work, _ in warm_rounds(kinds, rounds, "front-loop-kernel-", ProbeLoad):
        pid = server.proc.pid
        before = loop_thread(pid)
        result = bench_serve(server.base_url, work, f"{kind}-{r}", 400, float("inf"), 32, 64,
                             max_concurrency=8, client_nice=-10)
        after = loop_thread(pid)
        tokens = result["total_output_tokens"]
        user, kernel, vol, invol = (b - a for a, b in zip(before, after))
        print(f"round {r + 1} {kind}: {result['request_throughput']:.1f} req/s; the loop's thread per token: "
              f"user {1e6 * user / tokens:.1f} µs, kernel {1e6 * kernel / tokens:.1f} µs, "
              f"{vol / tokens:.3f} voluntary and {invol / tokens:.3f} involuntary switches", flush=True)

if __name__ == "__main__":
    main()
