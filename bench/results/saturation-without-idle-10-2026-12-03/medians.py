"""Median ratios to `vllm serve` from run.log's per-round lines (the run was stopped after its 6th
round, before it wrote its own tables). python bench/results/saturation-without-idle-10-2026-12-03/medians.py"""
import re
import statistics
from pathlib import Path

LINE = re.compile(r"round (\d+) (\w+): ([\d.]+) req/s, \d+ tok/s, TTFT p50 ([\d.]+) ms, ITL p50 ([\d.]+) ms, ([\d.]+) CPU-ms/token")
rows: dict[int, dict[str, tuple[float, ...]]] = {}
for line in (Path(__file__).parent / "run.log").read_text().splitlines():
    if m := LINE.match(line):
        rows.setdefault(int(m[1]), {})[m[2]] = tuple(map(float, m.groups()[2:]))
rows = {r: v for r, v in rows.items() if len(v) == 4}
print(f"{len(rows)} complete rounds")
for kind in ("daemon", "daemon_without_idle", "daemon_standby_none"):
    cells = []
    for i, metric in enumerate(("throughput", "TTFT p50", "ITL p50", "CPU per token")):
        ratios = [rows[r][kind][i] / rows[r]["vllm_serve"][i] for r in sorted(rows)]
        cells.append(f"{metric} {statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"{kind}: " + "; ".join(cells))
