"""The garbage collector's share of the front's CPU per token at saturation, ``vllm serve``'s
API server against the daemon's process (with and without the standby): ``bench.serving_overhead``'s
load and window (``measure``: 400 prompts, 8 at a time, 32 in / 64 out), with a ``sitecustomize``
(``site/``) that times every collection by generation in every process it starts. Rounds
alternate the order.

    PYTHONPATH=. .venv/bin/python bench/results/front-gc-2026-11-29/gc_probe.py [rounds]
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PROBE = Path(tempfile.mkdtemp(prefix="gc-probe-"))
# before the harness is imported: it keeps the environment as it is then for every daemon
os.environ["PYTHONPATH"] = f"{HERE / 'site'}{os.pathsep}{ROOT}"
os.environ["GC_PROBE_DIR"] = str(PROBE)

from bench.serving_overhead import measure, warm_rounds  # noqa: E402


class Args:
    num_prompts, rate, input_len, output_len, max_concurrency, client_nice = 400, float("inf"), 32, 64, 8, -10


def gc_of(pid: int) -> dict:
    time.sleep(1.5)  # the next dump
    return json.loads((PROBE / f"{pid}.json").read_text())


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    kinds = ["vllm_serve", "daemon", "daemon_standby_none"]
    for r, kind, server, work, head in warm_rounds(kinds, rounds, "front-gc-", Args):
        pid = server.proc.pid
        before = gc_of(pid)
        result = measure(server, work, f"{kind}-{r}", head, Args)
        after = gc_of(pid)
        tokens = result["total_output_tokens"]
        parts = []
        for g in "012":
            n = after["gens"][g][0] - before["gens"][g][0]
            cpu = after["gens"][g][1] - before["gens"][g][1]
            parts.append(f"gen{g} {n} collections, {1e6 * cpu / tokens:.2f} µs/token"
                         + (f" ({1e3 * cpu / n:.2f} ms each)" if g == "2" and n else ""))
        total = sum(after["gens"][g][1] - before["gens"][g][1] for g in "012")
        print(f"round {r + 1} {kind}: {result['request_throughput']:.1f} req/s; front {1e3 * result['cpu_ms_per_token_front']:.1f} µs/token, "
              f"its loop {result['loop_cpu_us_per_token']:.1f} on a core + {result['loop_wait_us_per_token']:.1f} waiting "
              f"({result['loop_wait_us_per_run']:.1f} per run); TTFT outside vLLM {result['ttft_outside_ms']:.2f} ms; "
              f"GC {1e6 * total / tokens:.2f} µs/token: " + "; ".join(parts) + f"; frozen {after['frozen']}", flush=True)


if __name__ == "__main__":
    main()
