"""Is the warm standby's later first token (saturation, 2026-11-29: scheduled to first token 6.06
against 3.99 ms) the KV reserve's? ``bench.serving_overhead --saturation``'s rounds (client at -10,
6 alternating rounds, one Ray head) for three daemons: the defaults (warm standby, its worker's KV
cache from the standby's reserve), the same with ``standby_kv = "at_adoption"`` (the adopted worker
allocates it as a new one does), and ``standby = "none"``. Prints each round and the medians of the
figures that differed: TTFT p50, the engine's scheduled-to-first-token and step time.

    PYTHONPATH=. .venv/bin/python bench/results/saturation-night-2026-11-29/kvprobe.py ROUNDS
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from bench import serving_overhead as so
from bench.common import base_parser, start_daemon
from chaos.harness import RayHead

KV_AT_ADOPTION = "daemon_kv_at_adoption"
_start = so.start


def start(kind, work, head, extra=()):
    if kind != KV_AT_ADOPTION:
        return _start(kind, work, head, extra)
    server = start_daemon(work, head, executor="ray", extra=extra, standby_kv="at_adoption")
    try:
        server.wait_ready()
        server.wait_standby()
    except BaseException:
        server.stop()
        raise
    return server


def main() -> None:
    so.start = start
    args = base_parser(so.__doc__).parse_args([])
    args.rounds, args.client_nice, args.max_num_seqs = int(sys.argv[1]), -10, None
    args.num_prompts, args.rate, args.max_concurrency, args.input_len, args.output_len = 400, float("inf"), 8, 32, 64
    kinds = ["daemon", KV_AT_ADOPTION, "daemon_standby_none"]
    with tempfile.TemporaryDirectory() as tmp:
        head = RayHead(num_cpus=2).start()
        try:
            runs = so.run_rounds(kinds, Path(tmp), head, args)
        finally:
            head.stop()
    for key in ("p50_ttft_ms", "ttft_prefill_ms", "step_ms", "tokens_per_step", "request_throughput"):
        print(key, "; ".join(f"{k}: median {statistics.median(r[key] for r in runs[k]):.2f} "
                             f"({', '.join(f'{r[key]:.2f}' for r in runs[k])})" for k in kinds), flush=True)


if __name__ == "__main__":
    main()
