"""The front's main thread from ``sample.py``'s files here (py-spy's raw stacks, gzipped): CPU per
output token (µs) by phase of the request path, and by function, inclusive (on the stack) and
exclusive (the innermost frame), median over each server's rounds, daemon − ``vllm serve``.

A round's samples are scaled to its thread's own CPU per token (``/proc`` schedstat): a
sample's share of the thread's samples times that. (py-spy's samples, per second runnable,
covered 74–78 % of ``vllm serve``'s thread and 81–89 % of the daemon's: read failures drop
some, so their counts are not compared directly.)

    PYTHONPATH=. python3 bench/results/front-sampled-long-2026-11-29/analyse.py [top]
"""

import collections
import gzip
import json
import re
import sys
from pathlib import Path

from bench.differences import print_median_differences

HERE = Path(__file__).parent
PHASES = (  # (name, a frame in the stack that puts a sample there): the first that matches
    ("vLLM's output handler task", ("output_handler (vllm/v1/engine/async_llm.py",)),
    ("writing chunks (uvicorn's send, through the middlewares)", ("RequestResponseCycle.send (",)),
    ("making chunks (the stream's generators, the daemon's layers among them)", ("StreamingResponse.stream_response",)),
    ("a request up to its stream (HTTP, parsing, validation, add_request)",
     ("create_completion", "RequestResponseCycle.run_asgi", "Front.__call__")),
)
LOOP = "the event loop itself (no Python frame under it)"
REST = "the rest (the daemon's own tasks among them)"


def name(frame: str) -> str:
    """``func (path:line)`` without the line: one function."""
    return re.sub(r":\d+\)$", ")", frame)


def phase(frames: list[str]) -> str:
    stack = ";".join(frames)
    for label, marks in PHASES:
        if any(m in stack for m in marks):
            return label
    return LOOP if frames[-1].startswith("Runner.run") else REST


def per_token(raw: Path, info: dict) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """(inclusive, exclusive, by phase) µs on a core per output token."""
    lines = gzip.decompress(raw.read_bytes()).decode().splitlines()
    main_thread = [line for line in lines if not line.startswith("Thread._bootstrap")]
    samples = sum(int(line.rpartition(" ")[2]) for line in main_thread)
    scale = 1e6 * info["loop_run_s"] / info["tokens"] / samples
    incl, excl, phases = collections.Counter(), collections.Counter(), collections.Counter()
    for line in main_thread:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count) * scale
        for f in {name(f) for f in frames}:
            incl[f] += n
        excl[name(frames[-1])] += n
        phases[phase(frames)] += n
    return incl, excl, phases


def main() -> None:
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    runs: dict[str, list] = collections.defaultdict(list)
    for meta in sorted(HERE.glob("*.json")):
        info = json.loads(meta.read_text())
        runs[info["kind"]].append((info, *per_token(meta.with_suffix(".raw.gz"), info)))
    for kind, rs in runs.items():
        print(kind, "loop CPU per token (µs), by round:", [round(1e6 * r[0]["loop_run_s"] / r[0]["tokens"], 1) for r in rs])
    print("\nby phase, µs per token in each round: vllm serve | daemon")
    for label in [p for p, _ in PHASES] + [LOOP, REST]:
        cells = [" / ".join(f"{r[3].get(label, 0.0):.1f}" for r in runs[kind]) for kind in ("vllm_serve", "daemon")]
        print(f"  {label}: {cells[0]} | {cells[1]}")
    for what, k in (("inclusive", 1), ("exclusive", 2)):
        print_median_differences(what, runs, k, top)


if __name__ == "__main__":
    main()
