"""Both of 2026-12-03's afternoon saturation runs together (4 rounds at 14:51, 3 at 15:32): the daemon's
ratios to `vllm serve` by round and their medians, and parked against not parked by round.
python bench/results/saturation-parked-2-2026-12-03/medians.py"""
import re
import statistics
from pathlib import Path

LINE = re.compile(r"round (\d+) (\w+): ([\d.]+) req/s, \d+ tok/s, TTFT p50 ([\d.]+) ms, ITL p50 ([\d.]+) ms, ([\d.]+) CPU-ms/token")
METRICS = ("throughput", "TTFT p50", "ITL p50", "CPU per token")
rounds = []
for run in ("saturation-parked-2026-12-03", "saturation-parked-2-2026-12-03"):
    rows: dict[int, dict[str, tuple[float, ...]]] = {}
    for line in (Path(__file__).parents[1] / run / "run.log").read_text().splitlines():
        if m := LINE.match(line):
            rows.setdefault(int(m[1]), {})[m[2]] = tuple(map(float, m.groups()[2:]))
    rounds += [rows[r] for r in sorted(rows)]
print(f"{len(rounds)} rounds")
for kind in ("daemon", "daemon_without_park"):
    for i, metric in enumerate(METRICS):
        ratios = [r[kind][i] / r["vllm_serve"][i] for r in rounds]
        print(f"{kind} / vllm_serve, {metric}: median {statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})")
for i, metric in enumerate(METRICS):
    ratios = [r["daemon"][i] / r["daemon_without_park"][i] for r in rounds]
    print(f"parked / not parked, {metric}: median {statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})")
