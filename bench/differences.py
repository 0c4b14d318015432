"""Two servers' figures per output token side by side, key by key (a function, a shared object),
as the probes' analysers under ``bench/results/`` print them. Standard library only."""

from __future__ import annotations

import statistics
from typing import Any


def print_median_differences(title: str, runs: dict[str, list[Any]], index: int, top: int,
                             base: str = "vllm_serve", other: str = "daemon") -> None:
    """``runs``: each server's rounds, a round a tuple whose ``index``-th item maps a key to µs per
    token. Prints the ``top`` keys whose medians over the rounds differ most, ``other`` − ``base``."""
    keys = set().union(*(r[index] for rs in runs.values() for r in rs))
    rows = []
    for key in keys:
        med = {kind: statistics.median(r[index].get(key, 0.0) for r in rs) for kind, rs in runs.items()}
        rows.append((med[other] - med[base], med[base], med[other], key))
    rows.sort(key=lambda row: (-abs(row[0]), row[3]))  # ties by key: the same order every run
    print(f"\n{title}: {other} − {base.replace('_', ' ')}, µs per token (medians)")
    for d, b, o, key in rows[:top]:
        print(f"{d:+7.2f} {b:7.2f} {o:7.2f}  {key}")
