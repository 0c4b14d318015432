"""Would a lower CPU weight for the idle warm standby close the defaults' gap at saturation on
2 cores? Three servers in alternating rounds, each measured as ``bench.serving_overhead
--saturation`` measures (400 prompts, 8 streams, 32 in / 64 out, the client at niceness -10):
``vllm serve`` (Ray V2), the daemon with its defaults, and the same daemon whose standby (the
Ray worker and the engine core's fork server, every thread) was given niceness 15 from outside
once it was ready, as Ray gives its idle pooled workers. Root only (``setpriority``); the
probe changes nothing in the daemon.

    PYTHONPATH=. .venv/bin/python bench/results/standby-niced-2026-11-29/niced.py [rounds]
"""

import os
import sys

from bench.serving_overhead import SaturationLoad as Load, measure, print_ratios, report, standby_pids, warm_rounds

KINDS = ["vllm_serve", "daemon", "daemon_niced_standby"]
NICE = 15


def renice(pid: int, nice: int) -> int:
    """Every thread of ``pid`` to ``nice``; how many."""
    tids = os.listdir(f"/proc/{pid}/task")
    for tid in tids:
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    return len(tids)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r, kind, server, work, head in warm_rounds(KINDS, rounds, "standby-niced-", Load,
                                                   {"daemon_niced_standby": "daemon"}):
        if kind == "daemon_niced_standby":
            pids = standby_pids(server)
            print(f"  niceness {NICE}: " + ", ".join(f"pid {p} ({renice(p, NICE)} threads)" for p in pids), flush=True)
            assert pids, "no standby to renice"
        runs[kind].append(report(r, kind, measure(server, work, f"{kind}-{r}", head, Load)))
    print_ratios(runs, ("output_throughput", "cpu_ms_per_token", "p50_ttft_ms", "p50_itl_ms", "loop_wait_us_per_token"))


if __name__ == "__main__":
    main()
