"""Does the ready standby's running cost the daemon's first token at saturation, or does its being
there? (issue 42, 2026-12-04). Settled 60 s, the defaults' TTFT p50 read 1.155× ``vllm serve``'s in
one run and 0.989× in the next (``saturation-settled-2026-12-04``, ``…b``), and vLLM's scheduled →
first token stayed longer with the standby in 11 of their 14 rounds. Three
servers in alternating rounds, each measured as ``bench.serving_overhead --saturation`` measures
(400 prompts, 8 streams, 32 in / 64 out, the client at niceness -10), each left idle ``SETTLE_S``
after its warm-up: ``vllm serve`` (Ray V2), the daemon with its defaults, and the same daemon with
every process of its ready standby (its workers and the engine core's fork server) stopped with
SIGSTOP over the measurement and continued after it. Nothing of a frozen standby runs; its memory,
Ray's records of its actors and the daemon's handles stay. Root or the servers' owner only; the
probe changes nothing in the daemon.

    PYTHONPATH=. .venv/bin/python bench/results/standby-frozen-saturation-2026-12-04/frozen_sat.py ROUNDS [KIND ...]

The kinds after ``ROUNDS`` choose what is stopped (stop 88): ``daemon_standby_frozen`` (the whole
standby, the default), ``daemon_worker_frozen`` (its workers alone) or ``daemon_forkserver_frozen``
(the fork server alone); ``vllm_serve`` and ``daemon`` always run.
"""

import os
import sys

from bench.serving_overhead import SaturationLoad, measure, print_ratios, report, standby_pids, stopped, warm_rounds

FROZEN = {  # a probe kind: which of the ready standby's processes it stops
    "daemon_standby_frozen": standby_pids,
    "daemon_worker_frozen": lambda server: [w.get("pid") for w in server.status()["standby"]["workers"]],
    "daemon_forkserver_frozen": lambda server: [server.status()["standby"].get("forkserver_pid")],
}


class Load(SaturationLoad):
    settle_s = float(os.environ.get("SETTLE_S", "60"))


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    kinds = ["vllm_serve", "daemon", *(sys.argv[2:] or ["daemon_standby_frozen"])]
    unknown = set(kinds[2:]) - set(FROZEN)
    assert not unknown, f"unknown kinds {sorted(unknown)}: choose from {sorted(FROZEN)}"
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for r, kind, server, work, head in warm_rounds(kinds, rounds, "standby-frozen-sat-", Load, dict.fromkeys(FROZEN, "daemon")):
        pids = [p for p in FROZEN[kind](server) if p] if kind in FROZEN else []
        assert kind not in FROZEN or pids, f"no standby to stop: {server.status()['standby']}"
        if pids:
            print(f"  standby processes {pids} stopped over the load", flush=True)
        with stopped(pids):
            runs[kind].append(report(r, kind, measure(server, work, f"{kind}-{r}", head, Load)))
        if pids:  # the daemon saw nothing of the stop: the same standby, still ready
            print(f"  continued; standby {server.status()['standby']['state']}, pids {standby_pids(server)}", flush=True)
    print_ratios(runs, ("output_throughput", "cpu_ms_per_token", "p50_ttft_ms", "p50_itl_ms", "ttft_prefill_ms"))
    for kind in kinds[1:]:
        print(f"  {kind}, TTFT p50 by round: " + ", ".join(
            f"{a['p50_ttft_ms']:.1f}/{b['p50_ttft_ms']:.1f}" for a, b in zip(runs[kind], runs["vllm_serve"])))


if __name__ == "__main__":
    main()
