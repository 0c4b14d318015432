"""``record.py``'s reports side by side: µs on a core per output token, by shared object and by
symbol (self time), median of each server's rounds, and daemon − ``vllm serve``.

    PYTHONPATH=. python3 bench/results/front-native-2026-11-29/analyse.py [top] [subdir]
"""

import collections
import re
import sys
from pathlib import Path

from bench.differences import print_median_differences

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
        print_median_differences(title, runs, k, top)


if __name__ == "__main__":
    main()
