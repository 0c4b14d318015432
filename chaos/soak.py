"""Seeded randomized chaos soak: N faults under streaming load, one report.

    python -m chaos.soak --faults 20 --seed 7 --tp 2 --out reports/

Starts a private Ray head and the daemon (as a user would), computes a fault-free
reference, then for each fault runs a batch of streams, injects the fault mid-stream,
waits for READY, and records: detection latency, recovery time (kill → first token of
the new engine) and its phases, request outcomes, duplicated / missing tokens, and what is
left behind (placement groups, actors, processes, /dev/shm segments, fds, RSS, threads).
Writes ``chaos-report.json`` and ``chaos-report.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, RayHead, marked_pids, shm_segments, stale_actors
from chaos.load import PROMPTS, as_reference, compare, first_token_after, run_with_fault

FAULTS = ["ray_kill", "sigkill_worker", "sigstop_worker", "kill_engine_core", "kill_all_workers", "double_fault"]


def proc_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"]),
        "fds": len(list(Path(f"/proc/{pid}/fd").iterdir())),
    }


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.rng = random.Random(args.seed)
        self.head = RayHead(num_cpus=max(2, args.tp)).start()
        config = {
            "engine": {"tensor_parallel_size": args.tp, "max_model_len": 1024},
            "ray": {"address": self.head.address},
            "supervisor": {"max_restarts": 10 * args.faults + 10, "probe_interval_s": 1.0, "hang_timeout_s": 6.0,
                           "probe_timeout_s": 5.0, "restart_backoff_initial_s": 0.2},
        }
        self.daemon = Daemon(workdir, config, env=OPERATOR_ENV).start()
        self.rows: list[dict[str, Any]] = []

    def status(self) -> dict:
        return self.daemon.status()

    def wait_ready(self, after_generation: int, timeout_s: float = 300) -> dict:
        return self.daemon.wait_generation(after_generation + 1, timeout_s)

    def fault(self, kind: str, generation: int) -> Callable[[], dict]:
        addr = self.head.address
        tp = self.args.tp

        def run() -> dict:
            if kind == "ray_kill":
                return inject.kill_worker(addr, rank=self.rng.randrange(tp))
            if kind == "sigkill_worker":
                return inject.signal_worker(addr, signal.SIGKILL, rank=self.rng.randrange(tp))
            if kind == "sigstop_worker":
                return inject.signal_worker(addr, signal.SIGSTOP, rank=self.rng.randrange(tp))
            if kind == "kill_engine_core":
                return inject.kill_engine_core(self.daemon.proc.pid)
            if kind == "kill_all_workers":
                return inject.kill_all_workers(addr)
            first = inject.kill_worker(addr, rank=self.rng.randrange(tp))  # double fault: again while recovering
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if [w for w in inject.workers(addr) if f"-g{generation + 1}_" in w["name"] or w["name"].endswith(f"-g{generation + 1}")]:
                    inject.kill_worker(addr, match=f"-g{generation + 1}")
                    return first
                time.sleep(0.05)
            return first

        return run

    def leftovers(self, generation: int) -> dict[str, Any]:
        seen = inject.inspect(self.head.address)
        stale = stale_actors([a["name"] for a in seen["actors"]], self.status())
        unmapped = sorted(self.daemon.unmapped_segments())
        return {
            "placement_groups": len(seen["placement_groups"]),
            "actors": len(seen["actors"]),
            "stale_actors": stale,
            "processes": len(marked_pids(self.daemon.marker)),
            "shm_segments": len(shm_segments() - self.daemon.shm_before),
            "shm_unmapped": unmapped,
            **proc_stats(self.daemon.proc.pid),
        }

    def run(self) -> dict[str, Any]:
        self.daemon.wait_ready()
        records, _ = asyncio.run(run_with_fault(self.daemon.base_url, len(PROMPTS), self.args.max_tokens))
        reference = as_reference(records)
        baseline = {"generation": 1, **self.leftovers(1)}
        inject.prepare(self.head.address)  # so the first fault lands mid-stream, not seconds later
        for i in range(self.args.faults):
            kind = self.rng.choice(FAULTS)
            before = self.status()["generation"]
            started = time.monotonic()
            records, info = asyncio.run(run_with_fault(
                self.daemon.base_url, self.args.streams, self.args.max_tokens, self.fault(kind, before), offset=i))
            s = self.wait_ready(before)
            # a double fault makes two recoveries; report the first one (the one the fault started)
            recs = [r for r in s["recoveries"] if r["from_generation"] >= before]
            rec = recs[0] if recs else s["recoveries"][-1]
            kill_at = info["monotonic"]
            ready_at = recs[-1]["ready_monotonic"] if recs else None
            first = first_token_after(records, ready_at) if ready_at else None
            summary = compare(records, reference)
            row = {
                "fault": kind, "target": {k: v for k, v in info.items() if k != "monotonic"},
                "generation": s["generation"], "detect_ms": round((rec["detected_monotonic"] - kill_at) * 1000, 1),
                "recovery_s": round(first - kill_at, 2) if first else None, "recoveries": len(recs),
                "phases_s": {k: round(v, 3) for k, v in rec["phases_s"].items()}, **summary,
                "requests": len(records), "leftovers": self.leftovers(s["generation"]),
                "wall_s": round(time.monotonic() - started, 1),
            }
            self.rows.append(row)
            print(f"[{i + 1}/{self.args.faults}] {kind}: detect {row['detect_ms']} ms, recovery {row['recovery_s']} s, "
                  f"ok {summary['ok']}/{len(records)}, mismatched {summary['mismatched']}", flush=True)
        return {"baseline": baseline, "faults": self.rows}

    def close(self) -> dict[str, Any]:
        return stop_and_inspect(self.daemon, self.head)


def stop_and_inspect(daemon: Daemon, head: RayHead) -> dict[str, Any]:
    """SIGTERM the daemon, then report its exit, what it left locally and on the cluster; stop
    the Ray head."""
    code, took = daemon.stop(signal.SIGTERM)
    try:
        daemon.assert_nothing_left()
        left = "none"
    except AssertionError as exc:
        left = str(exc)
    final = inject.inspect(head.address)
    inject.disconnect()
    head.stop()
    return {"exit_code": code, "stop_s": round(took, 2), "left_after_stop": left, "cluster_after_stop": final}


TREND_SERIES = [("rss_kib", "daemon RSS (MiB)", 1 / 1024), ("fds", "daemon fds", 1), ("threads", "daemon threads", 1),
                ("processes", "daemon child processes", 1), ("shm_segments", "/dev/shm segments (ours)", 1),
                ("actors", "Ray actors", 1), ("placement_groups", "placement groups", 1)]


def slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, 2, …"""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def trends(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per series: baseline, first / last value after a fault, max, and the slope per fault over
    all faults and over the second half (a leak keeps rising; a cache that fills levels off)."""
    out = []
    rows = report["faults"]
    for key, label, scale in TREND_SERIES:
        ys = [r["leftovers"][key] * scale for r in rows]
        if not ys:
            continue
        out.append({"series": label, "baseline": report["baseline"][key] * scale, "after_first": ys[0],
                    "last": ys[-1], "max": max(ys), "slope_all": slope(ys), "slope_second_half": slope(ys[len(ys) // 2:])})
    return out


def render_markdown(report: dict[str, Any]) -> str:
    rows = report["faults"]
    detect = [r["detect_ms"] for r in rows if r["fault"] != "sigstop_worker"]
    hang = [r["detect_ms"] for r in rows if r["fault"] == "sigstop_worker"]
    rec = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]

    def dist(xs: list[float]) -> str:
        return f"{min(xs):g} / {statistics.median(xs):g} / {max(xs):g}" if xs else "–"

    total = {k: sum(r[k] for r in rows) for k in ("requests", "ok", "failed", "mismatched", "tokens_duplicated", "tokens_missing")}
    counts = ", ".join(f"{k}: {sum(r['fault'] == k for r in rows)}" for k in FAULTS)
    lines = [
        f"# Chaos soak report ({report['started']}, seed {report['seed']}, TP={report['tp']})", "",
        f"- faults injected: {len(rows)} ({counts})",
        f"- detection latency, crash faults (min / median / max): {dist(detect)} ms",
        f"- detection latency, hangs (SIGSTOP): {dist(hang)} ms",
        f"- recovery, kill → first token of the new engine: {dist(rec)} s",
        f"- requests: {total['requests']} total, {total['ok']} ok, {total['failed']} failed; "
        f"{total['mismatched']} mismatched, {total['tokens_duplicated']} tokens duplicated, {total['tokens_missing']} missing",
        f"- stop: exit {report['close']['exit_code']} in {report['close']['stop_s']} s; left behind: {report['close']['left_after_stop']}; "
        f"cluster after stop: {report['close']['cluster_after_stop']}", "",
        "## Trends after each fault", "",
        "| series | baseline | after fault 1 | after last fault | max | slope per fault, all | slope per fault, second half |",
        "| - | - | - | - | - | - | - |",
        *[f"| {t['series']} | {t['baseline']:.0f} | {t['after_first']:.0f} | {t['last']:.0f} | {t['max']:.0f} | "
          f"{t['slope_all']:+.2f} | {t['slope_second_half']:+.2f} |" for t in trends(report)],
        "", "## Each fault", "",
        "| # | fault | detect ms | recovery s | engine start s | ok / req | mismatched | PGs | actors | procs | shm | unmapped shm | RSS MiB | threads | fds |",
        "| - | - | - | - | - | - | - | - | - | - | - | - | - | - | - |",
    ]
    for i, r in enumerate(rows, 1):
        lo = r["leftovers"]
        lines.append(
            f"| {i} | {r['fault']} | {r['detect_ms']} | {r['recovery_s']} | {r['phases_s'].get('engine_start', '–')} | "
            f"{r['ok']}/{r['requests']} | {r['mismatched']} | {lo['placement_groups']} | {lo['actors']} | {lo['processes']} | "
            f"{lo['shm_segments']} | {len(lo['shm_unmapped'])} | {lo['rss_kib'] // 1024} | {lo['threads']} | {lo['fds']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Trends after each fault (needs matplotlib: the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["faults"]
    x = list(range(len(rows) + 1))
    series = {label: [report["baseline"][key] * scale] + [r["leftovers"][key] * scale for r in rows]
              for key, label, scale in TREND_SERIES}
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.0 * len(series)), sharex=True)
    for ax, (label, ys) in zip(axes, series.items()):
        ax.plot(x, ys, marker=".")
        ax.set_ylabel(label, fontsize=8)
        ax.set_ylim(bottom=0, top=max(ys) * 1.2 + 1)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("faults injected")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"vllm-supervisor soak: {len(rows)} faults, seed {report['seed']}, TP={report['tp']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.soak")
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--plot", action="store_true", help="also write chaos-trends.png (matplotlib)")
    parser.add_argument("--render", type=Path, metavar="REPORT.json", help="only re-render a saved report (Markdown, plot)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        report = json.loads(args.render.read_text())
        (args.out / args.render.with_suffix(".md").name).write_text(render_markdown(report))
        if args.plot:
            plot(report, args.out / args.render.with_name(args.render.stem + "-trends.png").name)
        return 0
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seed": args.seed, "tp": args.tp}
    soak = Soak(args, Path(tempfile.mkdtemp(prefix="chaos-soak-")))
    try:
        report.update(soak.run())
    except BaseException:
        traceback.print_exc()  # now: stopping the Ray head below can make Ray abort this process
        raise
    finally:
        report["close"] = soak.close()
    (args.out / "chaos-report.json").write_text(json.dumps(report, indent=2))
    (args.out / "chaos-report.md").write_text(render_markdown(report))
    if args.plot:
        plot(report, args.out / "chaos-trends.png")
    print(render_markdown(report))
    bad = sum(r["failed"] + r["mismatched"] for r in report["faults"]) or report["close"]["exit_code"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
