"""Recovery time, in one run on one machine, for each tensor-parallel size asked:

1. the engine's cold start inside the warm daemon process (``ctl restart`` with
   ``standby = none``: its engine_start phase);
2. kill → first token of the new engine without the standby (``ray.kill`` of a worker
   mid-stream, ``standby = none``);
3. kill → first token with the warm standby (``standby = warm``; each kill waits until the
   standby for the next generation is ready), and where that recovery's time goes;
   in 2 and 3 each kill lands under ``--streams`` streaming clients (openai SDK), and the
   largest gap each of them read (between two chunks, or from its request to its first
   chunk) is reported too: what a client sees of the recovery;
4. the anchor users have today: ``vllm serve`` whose worker is killed, restarted by a
   supervisor loop the way systemd would (``Restart=always``), until its first token.

    python -m bench.recovery --tp 1 2 --kills 5 --anchors 2
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import tempfile
import time
import traceback
from datetime import datetime
from pathlib import Path

import httpx

from bench.common import MODEL_NAME, VllmServe, base_parser, gaps_in, p99, process_usage, spread, start_daemon
from chaos import inject
from chaos.harness import BIN, Daemon, RayHead
from chaos.load import first_token_after, run_with_fault


def first_token(base_url: str, deadline: float) -> float:
    """Poll with one-token requests until the server answers; the monotonic time it did."""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1},
                           timeout=30)
            if r.status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server never answered")


def anchor_process_restart(work: Path, head: RayHead, reps: int, tp: int) -> list[float]:
    """vllm serve + a restart loop: kill a worker, wait for the process to exit, start it
    again (as systemd's Restart=always would), measure kill → first token."""
    times = []
    for i in range(reps):
        server = VllmServe(work, head, tp=tp).start()
        server.wait_ready()
        first_token(server.base_url, time.monotonic() + 60)
        killed = inject.kill_worker(head.address, match="")
        kill_at = killed["monotonic"]
        try:
            code = server.proc.wait(120)
        except subprocess.TimeoutExpired:
            code = "hung"
        server.stop()  # reaps it and removes the shared memory it left
        restarted = VllmServe(work, head, tp=tp)
        restarted.port, restarted.base_url = server.port, server.base_url
        restarted.cmd[restarted.cmd.index("--port") + 1] = str(server.port)
        restarted.start()
        got = first_token(restarted.base_url, time.monotonic() + 300)
        times.append(got - kill_at)
        print(f"TP={tp} anchor {i + 1}: vllm serve exited with {code}; kill → first token after restart {got - kill_at:.1f} s", flush=True)
        restarted.stop()
        time.sleep(2)
    return times


def kills(daemon: Daemon, head: RayHead, n: int, tp: int, standby: bool,
          streams: int = 4) -> tuple[list[float], list[float], list[dict]]:
    """``n`` kills under ``streams`` streams: kill → first token (s), detection (ms), recovery
    records (each with ``gaps_s``: every stream's largest gap from the kill to that first token)."""
    recover, detect, records_out = [], [], []
    for i in range(n):
        gen = daemon.status()["generation"]
        if standby:
            daemon.wait_standby(for_generation=gen + 1, timeout_s=300)
        records, info = asyncio.run(run_with_fault(
            daemon.base_url, streams, 400, lambda: inject.kill_worker(head.address, rank=i % tp), offset=i))
        s = daemon.wait_generation(gen + 1)
        rec = s["recoveries"][-1]
        detect.append((rec["detected_monotonic"] - info["monotonic"]) * 1000)
        first = first_token_after(records, rec["ready_monotonic"])
        assert first is not None and all(r.outcome == "ok" for r in records), [r.error for r in records]
        recover.append(first - info["monotonic"])
        rec["kill_to_first_token_s"] = recover[-1]
        rec["gaps_s"] = [round(g, 3) for g in gaps_in(records, info["monotonic"], first, streams)]
        records_out.append(rec)
        label = f"with standby ({(rec.get('standby') or {}).get('result')})" if standby else "without standby"
        print(f"TP={tp} kill {i + 1} {label}: detection {detect[-1]:.1f} ms, kill → first token {recover[-1]:.1f} s, "
              f"largest gap per stream max {max(rec['gaps_s']):.2f} s, "
              f"phases {{{', '.join(f'{k}: {v:.2f}' for k, v in rec['phases_s'].items())}}}", flush=True)
    return recover, detect, records_out


def _ts(line: dict) -> float:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def build_phases(daemon: Daemon) -> list[dict[str, float]]:
    """Inside each engine build (from the daemon's log): config + engine-core process start,
    engine-core init before its executor, the executor (workers adopted or created, device,
    model load), vLLM's KV cache + warm-up, and the rest (handshakes, client)."""
    text = daemon.log_path.read_text(errors="replace")
    builds: dict[int, dict[str, float]] = {}
    for raw in text.splitlines():
        if raw.startswith("{"):
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if line.get("event") == "building engine":
                builds[line["engine_generation"]] = {"build_start": _ts(line)}
            elif line.get("event") == "engine up" and line.get("engine_generation") in builds:
                builds[line["engine_generation"]]["build_end"] = _ts(line)
        elif "executor timing " in raw:
            t = json.loads(raw.split("executor timing ", 1)[1])
            builds.setdefault(t["generation"], {}).update(t)
        elif "init engine (profile, create kv cache, warmup model) took" in raw:
            m = re.search(r"took ([\d.]+) s", raw)
            last = max(builds) if builds else None
            if m and last is not None:
                builds[last]["kv_warmup_s"] = float(m.group(1))
    out = []
    for gen, b in sorted(builds.items()):
        if not {"build_start", "build_end", "executor_start_unix", "executor_s", "kv_warmup_s"} <= set(b):
            continue
        total = b["build_end"] - b["build_start"]
        # Both ends on the wall clock of one host (/proc's process start time is too coarse here:
        # it comes out up to a second off, so the engine core's start is not split off).
        p = {"generation": gen, "total": total,
             "config + engine core up to its executor": b["executor_start_unix"] - b["build_start"],
             "executor: workers, device, model": b["executor_s"],
             "KV cache + warm-up": b["kv_warmup_s"], "adopted": bool(b.get("adopted"))}
        p["handshakes + client"] = total - sum(v for k, v in p.items() if k not in ("generation", "total", "adopted"))
        out.append(p)
    return out


def idle_cost(daemon: Daemon, window_s: float = 30.0) -> dict:
    """RSS and CPU of the standby's processes while it waits (same host only)."""
    sb = daemon.wait_standby()["standby"]
    pids = {"fork server": sb["forkserver_pid"], **{f"worker rank {w['rank']}": w["pid"] for w in sb["workers"]}}
    return process_usage(pids, window_s)


def run_tp(work: Path, head: RayHead, tp: int, args) -> dict:
    socket_of = lambda d: f"/tmp/vllm-supervisor-{d.port}.sock"  # noqa: E731
    out: dict = {}
    for sub in (f"cold-tp{tp}", f"warm-tp{tp}"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    with start_daemon(work / f"cold-tp{tp}", head, tp=tp, max_model_len=1024, max_restarts=1000, standby="none") as daemon:
        daemon.wait_ready()
        cold = []
        for i in range(args.cold_starts):
            gen = daemon.status()["generation"]
            subprocess.run([str(BIN / "vllm-supervisor"), "ctl", "--socket", socket_of(daemon), "restart"], check=True, capture_output=True)
            s = daemon.wait_generation(gen + 1)
            cold.append(s["recoveries"][-1]["phases_s"]["engine_start"])
            print(f"TP={tp} cold start in the warm process {i + 1}: {cold[-1]:.1f} s", flush=True)
        inject.prepare(head.address)
        out["recovery_none_s"], out["detect_none_ms"], recs_none = kills(daemon, head, args.kills, tp, standby=False,
                                                                               streams=args.streams)
        out["recovery_phases_none"] = [r["phases_s"] for r in recs_none]
        out["gaps_none_s"] = [g for r in recs_none for g in r["gaps_s"]]
        out["phases_none"] = build_phases(daemon)[-args.kills:]
        daemon.stop()
    out["cold_start_s"] = cold
    with start_daemon(work / f"warm-tp{tp}", head, tp=tp, max_model_len=1024, max_restarts=1000, standby="warm") as daemon:
        daemon.wait_ready()
        out["standby_idle"] = idle_cost(daemon)
        print(f"TP={tp} standby idle cost: {out['standby_idle']}", flush=True)
        out["recovery_warm_s"], out["detect_warm_ms"], recs = kills(daemon, head, args.kills, tp, standby=True,
                                                                               streams=args.streams)
        out["standby_results"] = [(r.get("standby") or {}).get("result") for r in recs]
        out["recovery_phases_warm"] = [r["phases_s"] for r in recs]
        out["gaps_warm_s"] = [g for r in recs for g in r["gaps_s"]]
        out["streams"] = args.streams
        out["phases_warm"] = build_phases(daemon)[-args.kills:]
        out["standby_ready_after_s"] = daemon.status()["standby"]["ready_after_s"]
        daemon.stop()
    out["process_restart_s"] = anchor_process_restart(work, head, args.anchors, tp) if args.anchors else []
    return out


def median_phases(rows: list[dict]) -> dict[str, float]:
    keys = [k for k in (rows[0] if rows else {}) if k not in ("generation", "adopted")]
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def report(tp: int, r: dict) -> list[str]:
    med = statistics.median
    lines = [
        f"### TP={tp}",
        "",
        "| measurement | n | min / median / max |",
        "| --- | --- | --- |",
        f"| engine cold start inside the warm daemon (s) | {len(r['cold_start_s'])} | {spread(r['cold_start_s'])} |",
        f"| kill → first token, no standby (s) | {len(r['recovery_none_s'])} | {spread(r['recovery_none_s'])} |",
        f"| kill → first token, warm standby (s) | {len(r['recovery_warm_s'])} | {spread(r['recovery_warm_s'])} |",
        f"| detection latency: kill → worker-death event (ms) | {len(r['detect_warm_ms'])} | {spread(r['detect_warm_ms'])} |",
    ]
    for kind in ("none", "warm"):
        gaps = r.get(f"gaps_{kind}_s")
        if gaps:  # runs before the streams' gaps were recorded have none
            lines.append(f"| largest gap per stream, {r['streams']} streams, {'no' if kind == 'none' else 'warm'} standby "
                         f"(s): p50 / p99 / max | {len(gaps)} | {statistics.median(gaps):.3f} / {p99(gaps):.3f} / {max(gaps):.3f} |")
    if r["process_restart_s"]:
        lines.append(f"| vllm serve + restart loop: kill → first token (s) | {len(r['process_restart_s'])} | {spread(r['process_restart_s'])} |")
    cold, warm = med(r["cold_start_s"]), med(r["recovery_warm_s"])
    lines += ["", f"- standby builds adopted: {r['standby_results'].count('adopted')} of {len(r['standby_results'])}; "
              f"the standby was ready {r['standby_ready_after_s']} s after the previous generation",
              f"- warm standby recovery / engine cold start: **{warm / cold:.2f}** (goal ≤ 0.08)",
              f"- no-standby recovery / engine cold start: {med(r['recovery_none_s']) / cold:.2f}"]
    if r.get("gaps_warm_s"):
        lines.append(f"- largest gap per stream p99 with the warm standby: **{p99(r['gaps_warm_s']):.2f} s** (goal ≤ 2.5 s at 16 streams)")
    if r["process_restart_s"]:
        lines.append(f"- warm standby recovery / vllm serve restart: **{warm / med(r['process_restart_s']):.2f}** (goal ≤ 0.2)")
    idle = "; ".join(f"{k}: {v['rss_mib']} MiB RSS, {v['cpu_pct']} % CPU" for k, v in r["standby_idle"].items())
    lines.append(f"- standby idle cost over 30 s: {idle}")
    phases = median_phases(r["phases_warm"])
    phases_none = median_phases(r["phases_none"])
    rec = {k: med(p[k] for p in r["recovery_phases_warm"]) for k in r["recovery_phases_warm"][0]}
    rec_none = {k: med(p[k] for p in r["recovery_phases_none"]) for k in r["recovery_phases_none"][0]}
    lines += ["", "Where a recovery's time goes (medians, s):", "",
              "| phase | no standby | warm standby |", "| --- | --- | --- |"]
    for k in ("detect", "drain", "teardown", "placement_group", "engine_start"):
        lines.append(f"| {k} | {rec_none.get(k, 0):.2f} | {rec.get(k, 0):.2f} |")
    inside = ("config + engine core up to its executor", "executor: workers, device, model", "KV cache + warm-up",
              "handshakes + client")
    for k in inside:  # inside the engine build, when the daemon's log has the executor's timing line
        if k in phases:
            lines.append(f"| — {k} | {phases_none.get(k, 0):.2f} | {phases[k]:.2f} |")
    lines.append(f"| ready → first token of a parked stream | | {warm - sum(rec.values()):.2f} |")
    return lines + [""]


def write_report(results: dict, out: Path, day: str) -> str:
    """``recovery.md`` from a run's results (TP -> measurements); returns its text."""
    lines = [f"Recovery, {day}: demo model on CPU, one run on one machine", ""]
    for tp, r in results.items():
        lines += report(int(tp), r)
    text = "\n".join(lines)
    (out / "recovery.md").write_text(text)
    return text


def main() -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--anchors", type=int, default=2)
    parser.add_argument("--cold-starts", type=int, default=2)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--streams", type=int, default=16, help="streaming clients each kill lands under")
    parser.add_argument("--render", type=Path, help="re-render a saved recovery.json into --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:  # a saved run's recovery.json
        day = time.strftime("%Y-%m-%d", time.localtime(args.render.stat().st_mtime))
        print(write_report(json.loads(args.render.read_text()), args.out, day))
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    head = RayHead(num_cpus=2).start()
    results: dict = {}
    try:
        for tp in args.tp:
            results[tp] = run_tp(work, head, tp, args)
    except BaseException:
        traceback.print_exc()  # before the head goes: a driver that loses its GCS may abort the process
        raise
    finally:
        inject.disconnect()
        head.stop()
    (args.out / "recovery.json").write_text(json.dumps(results, indent=2))
    print(write_report(results, args.out, time.strftime("%Y-%m-%d")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
