"""Steady state: what each server costs while nothing fails and nobody asks anything.

Each server in turn, TP=``--tp`` (each value), on the demo model, started as a user starts it
(``vllm serve``: its own executor, and on Ray V2 with the daemon's executor class on a Ray head
of its own; the daemon: its private Ray cluster), then ``--requests`` completions, then quiet (for the
daemon with its warm standby: until the standby is ready), then ``--windows`` windows of
``--window-s`` seconds with nothing in flight. Measured over the server's whole process tree
(everything it started, Ray's processes included): CPU (user + system from ``/proc``, % of one
core), memory (PSS, from ``/proc/<pid>/smaps_rollup``: shared pages counted once), and the number
of processes; for the daemon with the standby, the standby's processes (fork server, standby
workers) apart.

    python -m bench.steady_state --tp 1 2 --window-s 30

Writes ``steady-state.md`` / ``.json`` to ``--out``; ratios are against ``vllm serve`` on the same
executor, measured in the same run.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.common import MODEL_NAME, VllmServe, base_parser, tree
from chaos.harness import Daemon, RayHead


def cpu_s(pid: int) -> float | None:
    """``bench.common.cpu_s``, or None for a process gone meanwhile."""
    try:
        return common.cpu_s(pid)
    except (OSError, IndexError, ValueError):
        return None


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith("Pss:")), 0)
    except OSError:
        return 0


def idle_window(root: int, window_s: float, marker: str | None = None) -> dict[str, Any]:
    """CPU of ``root``'s tree over ``window_s`` (processes alive at both ends, plus what those
    born during the window used), and its PSS and process count at the end."""
    before = {pid: cpu_s(pid) for pid in tree(root, marker)}
    time.sleep(window_s)
    pids = tree(root, marker)
    per: dict[str, float] = {}
    for pid in pids:
        now = cpu_s(pid)
        if now is not None:
            name = f"{title(pid)} ({pid})"
            per[name] = round(100 * (now - (before.get(pid) or 0.0)) / window_s, 2)
    top = dict(sorted(per.items(), key=lambda kv: -kv[1])[:12])
    pss = {f"{title(pid)} ({pid})": round(pss_kib(pid) / 1024) for pid in pids}
    return {"cpu_pct": round(sum(per.values()), 2), "pss_mib": sum(pss.values()), "processes": len(pids), "top": top,
            "pss_top": dict(sorted(pss.items(), key=lambda kv: -kv[1])[:8])}


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:60]
    except OSError:
        return "?"


def warm_up(base_url: str, n: int) -> None:
    for i in range(n):
        r = httpx.post(base_url + "/v1/completions", timeout=120,
                       json={"model": MODEL_NAME, "prompt": f"The quick brown fox {i}", "max_tokens": 32})
        r.raise_for_status()


def measure_windows(root: int, args, marker: str | None = None) -> dict[str, Any]:
    windows = [idle_window(root, args.window_s, marker) for _ in range(args.windows)]
    return {"cpu_pct": [w["cpu_pct"] for w in windows], "cpu_pct_median": statistics.median(w["cpu_pct"] for w in windows),
            "pss_mib": windows[-1]["pss_mib"], "processes": windows[-1]["processes"], "top_last_window": windows[-1]["top"],
            "pss_top": windows[-1]["pss_top"]}


def vllm_serve(work: Path, tp: int, ray: bool, args) -> dict[str, Any]:
    """``vllm serve`` as a user runs it (vLLM's default executor), or on Ray V2: the daemon's
    executor class on a Ray head of its own (``ray start --head``; its processes are counted).
    (vLLM's own ``--distributed-executor-backend ray`` with no address starts a local Ray whose
    GCS its engine core never reached on this machine.)"""
    head = RayHead(num_cpus=max(2, tp)).start() if ray else None
    try:
        server = VllmServe(work, head, tp=tp, max_model_len=256).start()
        try:
            server.wait_ready()
            warm_up(server.base_url, args.requests)
            time.sleep(args.settle_s)
            return measure_windows(server.proc.pid, args, head.marker if head else None)
        finally:
            server.stop()
    finally:
        if head is not None:
            head.stop()


def supervisor_serve(work: Path, tp: int, standby: str, args, executor: str = "ray") -> dict[str, Any]:
    config = {"engine": {"tensor_parallel_size": tp, "executor": executor}, "supervisor": {"standby": standby}}
    with Daemon(work, config, args=("--disable-uvicorn-access-log",), own_session=True).start() as daemon:
        daemon.wait_ready()
        warm_up(daemon.base_url, args.requests)
        status = daemon.wait_standby() if standby == "warm" else daemon.status()
        time.sleep(args.settle_s)
        result = measure_windows(daemon.proc.pid, args)
        sb = status.get("standby") or {}
        standby_pids = [p for p in [sb.get("forkserver_pid"), *(w.get("pid") for w in sb.get("workers") or [])] if p]
        if standby_pids:
            result["standby_pss_mib"] = round(sum(pss_kib(p) for p in standby_pids) / 1024)
            result["standby_processes"] = len(standby_pids)
        code, _ = daemon.stop()
        assert code == 0, daemon.tail()
    return result


SERVERS = {
    "vllm serve": lambda work, tp, args: vllm_serve(work, tp, False, args),
    "vllm serve on Ray V2": lambda work, tp, args: vllm_serve(work, tp, True, args),
    "vllm-supervisor serve (defaults: Ray V2, warm standby)": lambda work, tp, args: supervisor_serve(work, tp, "warm", args),
    "vllm-supervisor serve, standby none": lambda work, tp, args: supervisor_serve(work, tp, "none", args),
    "vllm-supervisor serve --distributed-executor-backend mp": lambda work, tp, args: supervisor_serve(work, tp, "none", args, "mp"),
}
# vllm serve on Ray V2 against vllm serve; each daemon against vllm serve on its executor
ANCHOR = {"vllm serve": None, "vllm serve on Ray V2": "vllm serve",
          "vllm-supervisor serve --distributed-executor-backend mp": "vllm serve"}
RAY_ANCHOR = "vllm serve on Ray V2"


def render(results: list[dict[str, Any]], args) -> str:
    lines = [f"# Steady state, idle ({time.strftime('%Y-%m-%d')}, demo model, {args.requests} requests then quiet, "
             f"{args.windows} × {args.window_s:.0f} s windows; whole process tree)", "",
             "| TP | server | processes | idle CPU, % of a core (median; windows) | vs the anchor (pp) | PSS (MiB) | vs the anchor | standby's PSS (MiB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        anchor_name = ANCHOR.get(r["server"], RAY_ANCHOR)
        anchor = next((a for a in results if a["tp"] == r["tp"] and a["server"] == anchor_name), None)
        if "error" in r:
            lines.append(f"| {r['tp']} | {r['server']} | failed: {r['error'][:120]} | | | | | |")
            continue
        if anchor is None or "error" in anchor:
            d_cpu = d_pss = "—"
        else:
            d_cpu = f"{r['cpu_pct_median'] - anchor['cpu_pct_median']:+.1f} (vs {anchor_name})"
            d_pss = f"{r['pss_mib'] / anchor['pss_mib']:.2f}×"
        windows = " / ".join(f"{c:g}" for c in r["cpu_pct"])
        lines.append(f"| {r['tp']} | {r['server']} | {r['processes']} | {r['cpu_pct_median']:g} ({windows}) | {d_cpu} | "
                     f"{r['pss_mib']} | {d_pss} | {r.get('standby_pss_mib', '—')} |")
    lines += ["", "Where the memory is (PSS, MiB; the largest processes of each tree, at the end):", ""]
    for r in results:
        if "pss_top" in r:
            lines.append(f"- TP={r['tp']}, {r['server']}: " + "; ".join(f"{k} {v}" for k, v in r["pss_top"].items()))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="steady-") as tmp:
        for tp in args.tp:
            for name in args.servers:
                work = Path(tmp) / f"tp{tp}-{len(results)}"
                work.mkdir()
                started = time.monotonic()
                try:
                    row = SERVERS[name](work, tp, args)
                except Exception as exc:  # noqa: BLE001 - one server that fails is a row, not the end
                    row = {"error": f"{type(exc).__name__}: {exc}"}
                row.update(server=name, tp=tp)
                print(f"TP={tp} {name}: {row} ({time.monotonic() - started:.0f} s)", flush=True)
                results.append(row)
    text = render(results, args)
    (args.out / "steady-state.md").write_text(text)
    (args.out / "steady-state.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
