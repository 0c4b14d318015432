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
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import RayHead
from bench.serving_overhead import alternating, measure, report, start, warm_up

KINDS = ["vllm_serve", "daemon", "daemon_niced_standby"]
NICE = 15


class Load:
    num_prompts, rate, max_concurrency, input_len, output_len, client_nice = 400, float("inf"), 8, 32, 64, -10


def renice(pid: int, nice: int) -> int:
    """Every thread of ``pid`` to ``nice``; how many."""
    tids = os.listdir(f"/proc/{pid}/task")
    for tid in tids:
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    return len(tids)


def standby_pids(server) -> list[int]:
    standby = server.status()["standby"]
    return [p for p in [standby.get("forkserver_pid"), *(w.get("pid") for w in standby["workers"])] if p]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    work = Path(tempfile.mkdtemp(prefix="standby-niced-"))
    head = RayHead(num_cpus=2).start()
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    try:
        for r, kind in alternating(KINDS, rounds):
            name = f"{kind}-{r}"
            (work / name).mkdir()
            server = start("daemon" if kind == "daemon_niced_standby" else kind, work / name, head)
            try:
                warm_up(server, work / name, name, Load)
                if kind == "daemon_niced_standby":
                    pids = standby_pids(server)
                    print(f"  niceness {NICE}: " + ", ".join(f"pid {p} ({renice(p, NICE)} threads)" for p in pids), flush=True)
                    assert pids, "no standby to renice"
                runs[kind].append(report(r, kind, measure(server, work / name, name, head, Load)))
            finally:
                server.stop()
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("\nmedian ratio to vllm_serve, by round:")
    for kind in KINDS[1:]:
        cells = []
        for key in ("output_throughput", "cpu_ms_per_token", "p50_ttft_ms", "p50_itl_ms", "loop_wait_us_per_token"):
            ratios = [a[key] / b[key] for a, b in zip(runs[kind], runs["vllm_serve"])]
            cells.append(f"{key} {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"  {kind}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
