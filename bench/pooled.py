"""Issue 42's saturation goals over the rounds of several ``bench.serving_overhead --saturation`` runs.

One run of 6–10 rounds on this 2-core machine does not resolve a 2 % goal: the host's speed moves
by ±10–25 % from round to round, and from hour to hour. Each round pairs a daemon with the
``vllm serve`` measured next to it, so its ratio is what each run's table takes the median of. This
pools the ratios of the runs named and takes their median, with a 90 % interval from a two-level
bootstrap: the runs are resampled, then the rounds within each one, so an hour that ran the
servers differently counts as one hour, not as ten independent rounds.

    python -m bench.pooled bench/results/saturation-night-2026-12-03 bench/results/saturation-watch-2026-12-03

Pick the runs whose code is the code being judged (the same request path and standby); the table
lists each run's own medians beside the pooled figure, so a run that stands out is seen.

``--same-state TOL`` keeps only the rounds whose two windows ran on a host in the same state: the
host gauge's Python loop (``bench.common.HostSpeed``, in each run since 2026-11-29) within TOL of
each other (0.1: ±10 %). This host runs in two states, the loop at 0.8–1.0 or at 1.2–1.5 ms, and
every process's CPU per token moves with it by 30–40 %: a round whose ``vllm serve`` ran fast and
whose daemon ran slow (or the other way) measures the host. Runs without the gauge are left out,
and the rounds of each other state are counted by which window was the slower, so a state that
followed one server would be seen.

``--parts`` says where a TTFT difference sits: per round, the difference ``kind`` − baseline of
the TTFT p50 and of each part the run measured (of the mean TTFT: outside vLLM's own, the way to
the engine core and back, the queue, the prefill; the front's event loop per token, on a core and
waiting for one), pooled as above, with the rounds it was positive in and its correlation with
the TTFT p50's difference across the rounds of each run. ``--state fast|slow`` keeps the
one-state rounds of one host state. ``--baseline`` compares with another kind of the same runs
(the defaults against ``daemon_standby_none``: the standby's share), without the goals' verdicts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from bench.serving_overhead import GOALS

SHORT = {"output_throughput": "throughput", "cpu_ms_per_token": "CPU per token", "p50_ttft_ms": "TTFT p50",
         "p50_itl_ms": "ITL p50"}


GAUGE = "host_python_ms"  # the host gauge's part that splits its two states


def gauge_ratios(result: dict, kind: str, baseline: str = "vllm_serve") -> list[float | None]:
    """Per round: the host gauge's Python loop in ``kind``'s window over ``baseline``'s (None
    where either has no gauge)."""
    gauge = {row["key"]: row for row in result["rows"]}.get(GAUGE, {})
    return [d / v if d and v else None for d, v in zip(gauge.get(kind, []), gauge.get(baseline, []))]


SLOW_FROM = 1.1  # ms of the gauge's Python loop: this host's fast state reads 0.8–1.0, its slow one 1.2–1.5


def same_state(result: dict, kind: str, tol: float, baseline: str = "vllm_serve", state: str | None = None) -> list[bool]:
    """Per round: whether ``kind``'s window and ``baseline``'s ran on a host in the same state
    (the gauge's Python loop within ``tol`` of each other; no gauge, not known: False), and
    with ``state`` ("fast" or "slow"), both in that one (both gauges below ``SLOW_FROM``, or neither)."""
    gauge = {row["key"]: row for row in result["rows"]}.get(GAUGE, {})
    windows = list(zip(gauge.get(baseline, []), gauge.get(kind, [])))
    return [q is not None and 1 / (1 + tol) <= q <= 1 + tol
            and (state is None or all((g < SLOW_FROM) == (state == "fast") for g in windows[i]))
            for i, q in enumerate(gauge_ratios(result, kind, baseline))]


def state_split(result: dict, kind: str, tol: float, baseline: str = "vllm_serve") -> tuple[int, int, int]:
    """The rounds of one run by the host's state: (same, ``kind``'s window the slower,
    ``baseline``'s the slower); rounds without the gauge are not counted."""
    known = [q for q in gauge_ratios(result, kind, baseline) if q is not None]
    slower, faster = sum(q > 1 + tol for q in known), sum(q < 1 / (1 + tol) for q in known)
    return len(known) - slower - faster, slower, faster


def paired(row: dict, kind: str, baseline: str, keep: list[bool] | None = None) -> dict[int, tuple[float, float]]:
    """Round → (``kind``'s figure, ``baseline``'s) in one row of a run's JSON: the rounds where
    both have one, and ``keep`` (per round) does not mark False."""
    return {i: (d, v) for i, (d, v) in enumerate(zip(row[kind], row[baseline]))
            if d is not None and v is not None and (keep is None or (i < len(keep) and keep[i]))}


def round_ratios(result: dict, kind: str, baseline: str = "vllm_serve",
                 keep: list[bool] | None = None) -> dict[str, list[float]]:
    """Each goal's per-round ratio ``kind`` / ``baseline`` in one run's JSON (rounds missing a
    figure left out, and the rounds ``keep`` marks False)."""
    rows = {row["key"]: row for row in result["rows"]}
    return {key: [d / v for d, v in paired(rows[key], kind, baseline, keep).values() if v] for key in GOALS}


def pooled_interval(runs: list[list[float]], level: float = 0.9, reps: int = 4000) -> tuple[float, float]:
    """A two-level bootstrap interval of the pooled median: the runs resampled with replacement,
    then the rounds within each chosen run (a fixed seed)."""
    rng = random.Random(0)
    runs = [r for r in runs if r]
    medians = []
    for _ in range(reps):
        sample = [x for run in rng.choices(runs, k=len(runs)) for x in rng.choices(run, k=len(run))]
        medians.append(statistics.median(sample))
    medians.sort()
    return medians[int((1 - level) / 2 * reps)], medians[int((1 + level) / 2 * reps) - 1]


def verdict(median: float, interval: tuple[float, float], op: str, goal: float) -> str:
    ok = (lambda x: x >= goal) if op == ">=" else (lambda x: x <= goal)
    return ("met" if ok(median) else "missed") + (", resolved" if ok(interval[0]) == ok(interval[1]) else ", within the noise")


def pool(results: dict[str, dict], kind: str, tol: float | None = None, baseline: str = "vllm_serve",
         state: str | None = None) -> dict:
    """Per goal: each run's median ratio, and the pooled median with its interval and verdict
    (over the rounds in one host state only, with ``tol``: ``same_state``; in ``state`` only)."""
    per_run = {name: round_ratios(result, kind, baseline,
                                  keep=None if tol is None else same_state(result, kind, tol, baseline, state))
               for name, result in results.items()}
    out = {}
    for key, (op, goal) in GOALS.items():
        runs = [per_run[name][key] for name in results]
        values = [x for run in runs for x in run]
        if not values:
            continue
        median, interval = statistics.median(values), pooled_interval(runs)
        out[key] = {"runs": {name: statistics.median(r) if r else None for name, r in zip(results, runs)},
                    "rounds": len(values), "median": median, "interval_90": interval, "goal": f"{op} {goal}",
                    "verdict": verdict(median, interval, op, goal)}
    return out


PARTS = {"p50_ttft_ms": ("TTFT p50", "ms"),
         "ttft_outside_ms": ("mean TTFT: outside vLLM's own (HTTP, the server's layers, in and out)", "ms"),
         "ttft_between_ms": ("mean TTFT: to the engine core and back", "ms"),
         "ttft_queue_ms": ("mean TTFT: in the engine core's queue", "ms"), "ttft_prefill_ms": ("mean TTFT: prefill", "ms"),
         "loop_cpu_us_per_token": ("the front's loop on a core, per token", "µs"),
         "loop_wait_us_per_token": ("the front's loop waiting for a core, per token", "µs")}


def correlation(xs: list[float], ys: list[float], groups: list[str] | None = None) -> float | None:
    """Pearson's r (None for fewer than 3 pairs or a constant series); with ``groups`` (each
    pair's run), of the pairs centred on their run's means, so that runs at different levels do
    not make a correlation of their own."""
    if len(xs) < 3:
        return None
    if groups is not None:
        xs, ys = _centred(xs, groups), _centred(ys, groups)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else None


def _centred(values: list[float], groups: list[str]) -> list[float]:
    means = {g: statistics.fmean(v for v, h in zip(values, groups) if h == g) for g in set(groups)}
    return [v - means[g] for v, g in zip(values, groups)]


def parts(results: dict[str, dict], kind: str, baseline: str = "vllm_serve",
          keep: dict[str, list[bool]] | None = None) -> dict:
    """Per TTFT part (``PARTS``) the runs measured: the per-round difference ``kind`` − ``baseline``
    pooled (median, two-level interval), the rounds where it was positive, and its correlation
    with the TTFT p50's difference over the rounds that have both, within runs (``correlation``).
    The parts divide the mean TTFT (``bench.serving_overhead.ttft_parts``), not the p50.
    ``keep``: per run, the rounds to count (``same_state``)."""
    diffs: dict[str, dict[str, dict[int, float]]] = {key: {} for key in PARTS}
    for name, result in results.items():
        rows = {row["key"]: row for row in result["rows"]}
        mask = keep.get(name) if keep is not None else None
        for key in PARTS:
            row = rows.get(key)
            if row is None or kind not in row or baseline not in row:
                continue
            diffs[key][name] = {i: d - v for i, (d, v) in paired(row, kind, baseline, mask).items()}
    out = {}
    ttft = diffs["p50_ttft_ms"]
    for key, per_run in diffs.items():
        values = [x for run in per_run.values() for x in run.values()]
        if not values:
            continue
        pairs = [(x, ttft[name][i], name) for name, run in per_run.items() for i, x in run.items() if i in ttft.get(name, {})]
        out[key] = {"rounds": len(values), "median": statistics.median(values),
                    "interval_90": pooled_interval([list(run.values()) for run in per_run.values()]),
                    "positive": sum(x > 0 for x in values),
                    "r_with_ttft": None if key == "p50_ttft_ms" or not pairs else correlation(*map(list, zip(*pairs)))}
    return out


def print_parts(results: dict[str, dict], kind: str, baseline: str, keep: dict[str, list[bool]] | None) -> None:
    print()
    print(f"where the TTFT difference sits: {kind} − {baseline} per round, pooled (90 % interval, runs then rounds "
          f"resampled); the parts divide the mean TTFT; r: the correlation with the TTFT p50's difference across "
          f"rounds, within runs")
    print()
    print("| part | difference | rounds > 0 | r with TTFT p50 |")
    print("| --- | --- | --- | --- |")
    for key, g in parts(results, kind, baseline, keep).items():
        label, unit = PARTS[key]
        lo, hi = g["interval_90"]
        r = "" if key == "p50_ttft_ms" else "n/a" if g["r_with_ttft"] is None else f"{g['r_with_ttft']:+.2f}"
        print(f"| {label} | {g['median']:+.2f} {unit} ({lo:+.2f} to {hi:+.2f}) | {g['positive']}/{g['rounds']} | {r} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="result directories of bench.serving_overhead --saturation")
    parser.add_argument("--kind", default="daemon", help="the daemon kind compared")
    parser.add_argument("--same-state", type=float, metavar="TOL", default=None,
                        help="only the rounds whose two windows' host gauge (its Python loop) is within TOL (0.1)")
    parser.add_argument("--state", choices=("fast", "slow"), help="with --same-state: only the rounds in this host "
                        f"state (the gauge's Python loop below {SLOW_FROM} ms, or not)")
    parser.add_argument("--baseline", default="vllm_serve", help="the kind compared with (another daemon kind: "
                        "daemon_standby_none for the standby's share)")
    parser.add_argument("--parts", action="store_true", help="also where the TTFT difference sits, part by part")
    args = parser.parse_args()
    if args.state and args.same_state is None:
        parser.error("--state needs --same-state")
    results = {}
    for run in args.runs:
        found = sorted(run.glob("serving_saturation*.json"))  # also ``_interleaved`` and ``_interleaved_alone``
        if len(found) != 1:
            print(f"{run.name}: {len(found)} saturation results (one expected), left out")
            continue
        result = json.loads(found[0].read_text())
        keys = {k for row in result["rows"] for k in row}
        if args.kind in keys and args.baseline in keys and (args.same_state is None or any(
                row["key"] == GAUGE for row in result["rows"])):
            results[run.name] = result
        else:
            print(f"{run.name}: no {args.kind} and {args.baseline} pair" + (" with the host gauge" if args.same_state else "")
                  + ", left out")
    pooled = pool(results, args.kind, args.same_state, args.baseline, args.state)
    names = list(results)
    print(f"{args.kind} / {args.baseline}, median ratio per run and pooled (90 % interval, runs then rounds resampled)")
    if args.same_state is not None:
        same, kind_slower, baseline_slower = (sum(x) for x in zip(*(state_split(r, args.kind, args.same_state, args.baseline)
                                                                      for r in results.values())))
        print(f"only the {same} rounds whose two windows ran in one host state (the gauge's Python loop within "
              f"±{args.same_state:.0%}); of the others, {args.kind}'s window was the slower in {kind_slower}, "
              f"{args.baseline}'s in {baseline_slower}")
        if args.state:
            kept = sum(sum(same_state(r, args.kind, args.same_state, args.baseline, args.state)) for r in results.values())
            print(f"and of those, only the {kept} in the {args.state} state (both windows' gauge "
                  f"{'below' if args.state == 'fast' else 'at or above'} {SLOW_FROM} ms)")
    print()
    print("| goal | " + " | ".join(names) + " | pooled |")
    print("| --- |" + " --- |" * (len(names) + 1))
    for key, g in pooled.items():
        cells = [f"{g['runs'][n]:.3f}" if g["runs"][n] is not None else "n/a" for n in names]
        lo, hi = g["interval_90"]
        print(f"| {SHORT[key]} {g['goal']} | " + " | ".join(cells)
              + f" | **{g['median']:.3f}** ({lo:.3f}–{hi:.3f}, {g['rounds']} rounds)"
              + (f": {g['verdict']} |" if args.baseline == "vllm_serve" else " |"))  # the goals are against vllm serve
    if args.parts:
        keep = None if args.same_state is None else {
            name: same_state(r, args.kind, args.same_state, args.baseline, args.state) for name, r in results.items()}
        print_parts(results, args.kind, args.baseline, keep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
