"""``record.py``'s reports side by side: µs on a core per output token, by shared object and by
symbol (self time), median of each server's rounds, and daemon − ``vllm serve``.

    python3 bench/results/front-native-2026-11-29/analyse.py [top] [subdir]
"""

import collections
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
LINE = re.compile(r"^\s+([0-9.]+)%\s+(.+?)\s*$")


def parse(path: Path) -> tuple[dict, dict]:
    """({dso: µs per token}, {dso sym: µs per token}) of one report."""
    text = path.read_text()
    tokens = float(re.search(r"tokens generated while recorded: ([0-9.]+)", text).group(1))
    parts = text.split("# Event count (approx.): ")[1:]  # the dso report, then the dso,sym report
    out = []
    for part in parts:
        ns = float(part.split("\n", 1)[0])
        table = {}
        for line in part.splitlines():
            m = LINE.match(line)
            if m:
                table[" ".join(m.group(2).split())] = float(m.group(1)) / 100 * ns / 1000 / tokens
        out.append(table)
    return out[0], out[1]


def main() -> None:
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    where = HERE / sys.argv[2] if len(sys.argv) > 2 else HERE
    runs = collections.defaultdict(list)
    for path in sorted(where.glob("*-*.txt")):
        runs[path.stem.rsplit("-", 1)[0]].append(parse(path))
    for kind, rs in runs.items():
        print(kind, "µs per token on a core, sampled:", [round(sum(d.values()), 1) for d, _ in rs])
    for title, k in (("by shared object", 0), ("by symbol", 1)):
        keys = set().union(*(r[k] for rs in runs.values() for r in rs))
        rows = []
        for key in keys:
            med = {kind: statistics.median(r[k].get(key, 0.0) for r in rs) for kind, rs in runs.items()}
            rows.append((med["daemon"] - med["vllm_serve"], med["vllm_serve"], med["daemon"], key))
        rows.sort(key=lambda row: -abs(row[0]))
        print(f"\n{title}: daemon − vllm serve, µs per token (medians)")
        for d, v, dm, key in rows[:top]:
            print(f"{d:+7.2f} {v:7.2f} {dm:7.2f}  {key}")


if __name__ == "__main__":
    main()
