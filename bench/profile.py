"""Where the CPU goes: ``py-spy`` samples of each busy process of a server at saturation (or idle),
the daemon beside ``vllm serve`` on the same executor and Ray head.

For each server: start it, warm it up, put ``vllm bench serve`` at saturation on it (8 streams
always in flight, 32 in / 64 out tokens), measure every process's CPU of its tree (and the Ray
head's) over the window, and ``py-spy record`` the busiest Python processes during the same window.
Prints, per process, its CPU share and the top frames by self and by inclusive samples; writes the
collapsed stacks (flame-graph input: ``flamegraph.pl`` or speedscope) under ``--out``.

    python -m bench.profile                       # vllm_serve, daemon_standby_none
    python -m bench.profile --kinds daemon --idle  # a server with no load
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import base_parser, bench_serve, tree, tree_cpu_s
from bench.serving_overhead import LABELS, engine_flags, start
from chaos import inject
from chaos.harness import RayHead
from executor import procfs

KINDS = tuple(LABELS)  # bench.serving_overhead's servers, started as it starts them


def name_of(pid: int) -> str:
    cmd = (procfs.read(pid, "cmdline") or b"").replace(b"\0", b" ").decode(errors="replace").strip()
    comm = (procfs.read(pid, "comm") or b"").decode(errors="replace").strip()
    return f"{comm}: {cmd[:90]}"


def short(frame: str) -> str:
    """py-spy's ``func (path/to/file.py:123)`` as ``func (file.py)``: one entry per function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else frame


def top_frames(collapsed: Path, n: int = 15) -> dict[str, list[tuple[str, int]]]:
    """Top frames by self and by inclusive samples, from py-spy's raw (collapsed) output."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [short(f) for f in stack.split(";")]
        c = int(count)
        total += c
        own[frames[-1]] += c
        for f in set(frames):
            incl[f] += c
    pct = lambda k: round(100 * k / max(1, total), 1)  # noqa: E731
    return {"samples": total, "self": [(f, pct(c)) for f, c in own.most_common(n)],
            "inclusive": [(f, pct(c)) for f, c in incl.most_common(n)]}


def profile(kind: str, work: Path, head: RayHead, args) -> dict:
    server = start(kind, work, head, engine_flags(args))
    try:
        bench_serve(server.base_url, work, f"warmup-{kind}", 8, float("inf"), 32, 64, seed=99)
        result: dict = {}
        load = None
        if not args.idle:
            def run() -> None:
                result["bench"] = bench_serve(server.base_url, work, kind, args.num_prompts, float("inf"), 32, 64,
                                              seed=0, max_concurrency=args.max_concurrency)
            load = threading.Thread(target=run)
            load.start()
            time.sleep(15)  # the client imported vLLM and the streams are in flight
        pids = tree(server.proc.pid, head.marker)
        before = tree_cpu_s(pids)
        time.sleep(2)
        mid = tree_cpu_s(pids)
        busy = sorted((p for p in mid if p in before), key=lambda p: mid[p] - before[p], reverse=True)
        sampled = busy[: args.top]
        print(f"{kind}: sampling {[(p, name_of(p)[:40], round(mid[p] - before[p], 2)) for p in sampled]}", flush=True)
        spies = {}
        for pid in sampled:
            out = work / f"{kind}-{pid}.collapsed"
            spies[pid] = (out, subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pid), "--duration", str(args.duration), "--rate", "100",
                 "--format", "raw", "--nonblocking", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        start_cpu = tree_cpu_s(pids)
        time.sleep(args.duration)
        end_cpu = tree_cpu_s(pids)
        procs = []
        for pid in sorted(end_cpu, key=lambda p: end_cpu[p] - start_cpu.get(p, 0), reverse=True):
            pct = 100 * (end_cpu[pid] - start_cpu.get(pid, 0)) / args.duration
            entry = {"pid": pid, "name": name_of(pid), "cpu_pct": round(pct, 1)}
            if pid in spies:
                out, proc = spies[pid]
                proc.wait(60)
                if out.exists() and out.stat().st_size:
                    entry["frames"] = top_frames(out)
                    shutil.copy(out, args.out / f"profile-{kind}-{'idle' if args.idle else 'sat'}-{pid}.collapsed")
                else:
                    entry["py_spy_error"] = proc.stderr.read().decode()[-300:]
            if pct >= 0.5 or pid in spies:
                procs.append(entry)
        if load is not None:
            load.join()
        return {"kind": kind, "idle": args.idle, "processes": procs,
                "throughput": result.get("bench", {}).get("output_throughput"),
                "ttft_p50_ms": result.get("bench", {}).get("p50_ttft_ms")}
    finally:
        server.stop()


def main() -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=["vllm_serve", "daemon_standby_none"])
    parser.add_argument("--idle", action="store_true")
    parser.add_argument("--duration", type=int, default=20)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-concurrency", type=int, default=8, help="streams always in flight")
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's --max-num-seqs for every server (bench.serving_overhead)")
    parser.add_argument("--top", type=int, default=4, help="how many of the busiest processes to sample")
    args = parser.parse_args()
    args.py_spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if args.py_spy is None:
        sys.exit("py-spy is not installed: pip install py-spy (make bench installs it)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    head = RayHead(num_cpus=2).start()
    reports = []
    try:
        for kind in args.kinds:
            (work / kind).mkdir()
            report = profile(kind, work / kind, head, args)
            reports.append(report)
            print(f"\n## {kind} ({'idle' if args.idle else 'saturation'}): {report['throughput']} tok/s, "
                  f"TTFT p50 {report['ttft_p50_ms']} ms")
            for p in report["processes"]:
                print(f"- {p['cpu_pct']:5.1f} %  {p['pid']} {p['name']}")
                for f, pct in p.get("frames", {}).get("self", [])[:12]:
                    print(f"      self {pct:5.1f} %  {f}")
                for f, pct in p.get("frames", {}).get("inclusive", [])[:15]:
                    print(f"      incl {pct:5.1f} %  {f}")
    finally:
        inject.disconnect()
        head.stop()
    name = f"profile-{'idle' if args.idle else 'saturation'}"
    (args.out / f"{name}.json").write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
