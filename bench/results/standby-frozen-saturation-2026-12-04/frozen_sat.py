"""Does the ready standby's running cost the daemon's first token at saturation, or does its being
there? (issue 42, 2026-12-04). Settled 60 s, the defaults' TTFT p50 stayed 1.155× ``vllm serve``'s
(``saturation-settled-2026-12-04``), so the price is no transient of the standby's making. Three
servers in alternating rounds, each measured as ``bench.serving_overhead --saturation`` measures
(400 prompts, 8 streams, 32 in / 64 out, the client at niceness -10), each left idle ``SETTLE_S``
after its warm-up: ``vllm serve`` (Ray V2), the daemon with its defaults, and the same daemon with
every process of its ready standby (its workers and the engine core's fork server) stopped with
SIGSTOP over the measurement and continued after it. Nothing of a frozen standby runs; its memory,
Ray's records of its actors and the daemon's handles stay. Root or the servers' owner only; the
probe changes nothing in the daemon.

    PYTHONPATH=. .venv/bin/python bench/results/standby-frozen-saturation-2026-12-04/frozen_sat.py ROUNDS
"""

import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RayHead
from bench.serving_overhead import alternating, measure, report, start, warm_up

KINDS = ["vllm_serve", "daemon", "daemon_standby_frozen"]
SETTLE_S = float(os.environ.get("SETTLE_S", "60"))


class Load:
    num_prompts, rate, max_concurrency, input_len, output_len, client_nice = 400, float("inf"), 8, 32, 64, -10


def standby_pids(server) -> list[int]:
    standby = server.status()["standby"]
    return [p for p in [standby.get("forkserver_pid"), *(w.get("pid") for w in standby["workers"])] if p]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    work = Path(tempfile.mkdtemp(prefix="standby-frozen-sat-"))
    head = RayHead(num_cpus=2).start()
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    try:
        for r, kind in alternating(KINDS, rounds):
            name = f"{kind}-{r}"
            (work / name).mkdir()
            server = start("daemon" if kind == "daemon_standby_frozen" else kind, work / name, head)
            stopped: list[int] = []
            try:
                warm_up(server, work / name, name, Load)
                time.sleep(SETTLE_S)
                if kind == "daemon_standby_frozen":
                    stopped = standby_pids(server)
                    assert len(stopped) >= 2, f"no standby to stop: {server.status()['standby']}"
                    for pid in stopped:
                        os.kill(pid, signal.SIGSTOP)
                    print(f"  standby processes {stopped} stopped over the load", flush=True)
                runs[kind].append(report(r, kind, measure(server, work / name, name, head, Load)))
            finally:
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
                if stopped:  # the daemon saw nothing of the stop: the same standby, still ready
                    standby = server.status()["standby"]
                    print(f"  continued; standby {standby['state']}, pids {standby_pids(server)}", flush=True)
                server.stop()
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("\nmedian ratio to vllm_serve (min-max), by round:")
    for kind in KINDS[1:]:
        cells = []
        for key in ("output_throughput", "cpu_ms_per_token", "p50_ttft_ms", "p50_itl_ms", "ttft_prefill_ms"):
            ratios = [a[key] / b[key] for a, b in zip(runs[kind], runs["vllm_serve"]) if a[key] and b[key]]
            cells.append(f"{key} {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"  {kind}: " + ", ".join(cells))
        print(f"    TTFT p50 by round: " + ", ".join(f"{a['p50_ttft_ms']:.1f}/{b['p50_ttft_ms']:.1f}"
                                                     for a, b in zip(runs[kind], runs["vllm_serve"])))


if __name__ == "__main__":
    main()
