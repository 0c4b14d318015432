"""The front's event-loop thread's system calls per output token, in ``vllm serve`` and the
daemon: ``strace -c`` on the main thread alone (not ``-f``) for 12 s in the middle of a
saturation load (2000 prompts, 8 at a time, 32 in / 64 out), in alternating rounds. strace
slows the thread, so the counts, not the times, are what compare; tokens are counted over the
traced window from the server's own ``vllm:generation_tokens_total``.

    PYTHONPATH=. .venv/bin/python bench/results/front-syscalls-2026-11-29/count.py [rounds]
"""

import subprocess
import sys
from pathlib import Path

from bench.serving_overhead import ProbeLoad, tokens_while, warm_rounds

HERE = Path(__file__).parent
TRACE_S = 12.0


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for r, kind, server, work, _ in warm_rounds(["vllm_serve", "daemon"], rounds, "front-syscalls-", ProbeLoad):
        out = HERE / f"{kind}-{r}.strace"
        tokens = tokens_while(server, work, f"{kind}-{r}", lambda: subprocess.run(
            ["timeout", "-s", "INT", str(TRACE_S), "strace", "-c", "-o", str(out), "-p", str(server.proc.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        print(f"round {r + 1} {kind}: {tokens:.0f} tokens traced", flush=True)
        lines = out.read_text().splitlines()
        out.write_text("\n".join([f"# tokens generated while traced: {tokens:.0f}", *lines]) + "\n")
        for line in lines:
            parts = line.split()
            if len(parts) >= 5 and parts[3].isdigit():
                print(f"  {parts[-1]:<16} {int(parts[3]) / tokens:.3f} per token", flush=True)


if __name__ == "__main__":
    main()
