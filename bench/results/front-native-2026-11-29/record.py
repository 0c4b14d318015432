"""The front's event-loop thread in native code, per output token, in ``vllm serve`` and the
daemon: ``perf record`` (the kernel's ``cpu-clock`` software event, 999 Hz: this VM has no
hardware counters) on the main thread alone for 12 s (or as given) in the middle of a saturation load (2000
prompts, 8 at a time, 32 in / 64 out), in alternating rounds. Each sample is ≈ 1 ms on a core;
tokens are counted over the window from the server's ``vllm:generation_tokens_total``. Writes
``<kind>-<round>.txt``: ``perf report`` by shared object and by symbol (self time).

    PYTHONPATH=. .venv/bin/python bench/results/front-native-2026-11-29/record.py [rounds] [seconds] [subdir]
"""

import subprocess
import sys
from pathlib import Path

from bench.serving_overhead import ProbeLoad, tokens_while, warm_rounds

HERE = Path(__file__).parent
HZ = 999


def report(data: Path, sort: str) -> str:
    return subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", sort, "--stdio",
                           "-g", "none", "--percent-limit", "0.1"], capture_output=True, text=True).stdout


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    seconds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    out = HERE / sys.argv[3] if len(sys.argv) > 3 else HERE
    out.mkdir(exist_ok=True)
    for r, kind, server, work, _ in warm_rounds(["vllm_serve", "daemon"], rounds, "front-native-", ProbeLoad):
        data = work / "perf.data"
        tokens = tokens_while(server, work, f"{kind}-{r}", lambda: subprocess.run(
            ["perf", "record", "-e", "cpu-clock", "-F", str(HZ), "-g", "-t", str(server.proc.pid), "-o", str(data),
             "--", "sleep", str(seconds)], capture_output=True))
        text = f"# tokens generated while recorded: {tokens:.0f}\n" + report(data, "dso") + report(data, "dso,sym")
        (out / f"{kind}-{r}.txt").write_text(text)
        print(f"round {r + 1} {kind}: {tokens:.0f} tokens", flush=True)


if __name__ == "__main__":
    main()
