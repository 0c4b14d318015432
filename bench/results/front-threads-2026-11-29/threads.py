"""The front process's CPU by thread over one saturation load (``bench.serving_overhead``'s:
400 prompts, 8 at a time, 32 in / 64 out), for a daemon with the warm standby and without it, and
for ``vllm serve``: whether anything beside the event loop's thread takes the GIL's time while the
first tokens wait (``/proc/<pid>/task/*/stat``, utime + stime, and voluntary context switches).

    PYTHONPATH=. .venv/bin/python bench/results/front-threads-2026-11-29/threads.py
"""

import os
import tempfile
from pathlib import Path

from bench.common import bench_serve
from bench.serving_overhead import ProbeLoad, warm_server
from chaos.harness import RayHead

TICK = os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[str, tuple[float, int]]:
    """name (with tid) -> (CPU s, voluntary switches) for each thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        switches = int(next(line.split()[1] for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")))
        out[f"{name}/{tid}"] = ((int(fields[11]) + int(fields[12])) / TICK, switches)
    return out


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="front-threads-"))
    head = RayHead(num_cpus=2).start()
    try:
        for kind in ("vllm_serve", "daemon", "daemon_standby_none"):
            (work / kind).mkdir()
            with warm_server(kind, work / kind, head, kind, ProbeLoad) as server:
                pid = server.proc.pid
                before = threads(pid)
                result = bench_serve(server.base_url, work / kind, f"{kind}-run", 400, float("inf"), 32, 64,
                                     max_concurrency=8, client_nice=-10)
                after = threads(pid)
                tokens = result["total_output_tokens"]
                print(f"{kind}: {result['request_throughput']:.1f} req/s, TTFT p50 {result['p50_ttft_ms']:.1f} ms; "
                      f"front threads, CPU µs per token (voluntary switches):", flush=True)
                rows = sorted(((after[t][0] - before.get(t, (0.0, 0))[0], after[t][1] - before.get(t, (0.0, 0))[1], t)
                               for t in after), reverse=True)
                for cpu, switches, name in rows:
                    if cpu > 0 or switches > 50:
                        print(f"  {name:32s} {1e6 * cpu / tokens:8.2f} µs/token  ({switches} switches)", flush=True)
    finally:
        head.stop()


if __name__ == "__main__":
    main()
