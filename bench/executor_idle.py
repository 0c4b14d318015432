"""What an idle engine's Ray workers cost, per executor: the V2 executor (the default) vs vLLM's
compiled-graph executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``), in one run on one machine.

For each executor: a daemon with TP=``--tp`` and no standby on the same Ray head; once it is
ready, ``--requests`` completions, then ``--settle-s`` of nothing, then each worker actor's CPU
(user + system, from ``/proc``) and RSS over ``--window-s`` with no request in flight. Ray's
compiled-graph channels busy-poll while they wait for the next step; this measures what that
costs against the V2 executor's workers, which vLLM's shared-memory queue keeps busy-looping for
1 s after each step (then they sleep on a socket): with the daemon's canary every
``--probe-interval-s``, that second recurs.

    python -m bench.executor_idle --tp 2 --window-s 20
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import MODEL_NAME, base_parser, process_usage
from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, RayHead

EXECUTORS = {"ray V2 (default)": "1", "compiled graph": "0"}


def measure(work: Path, head: RayHead, name: str, v2: str, args) -> dict:
    config = {"engine": {"tensor_parallel_size": args.tp, "max_model_len": 1024},
              "ray": {"address": head.address}, "supervisor": {"standby": "none", "probe_interval_s": args.probe_interval_s}}
    env = {**OPERATOR_ENV, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": v2}
    (work / v2).mkdir(parents=True, exist_ok=True)
    with Daemon(work / v2, config, env=env).start() as daemon:
        daemon.wait_ready()
        for _ in range(args.requests):
            r = httpx.post(daemon.base_url + "/v1/completions", timeout=120,
                           json={"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 32})
            r.raise_for_status()
        time.sleep(args.settle_s)
        instance = daemon.status()["replicas"][0]["instance_id"]
        workers = {w["name"].rsplit("-g", 1)[-1]: w["pid"] for w in inject.workers(head.address, match=instance)}
        per_worker = process_usage(workers, args.window_s)
        daemon.stop()
    total = round(sum(w["cpu_pct"] for w in per_worker.values()), 1)
    print(f"{name}: idle workers {per_worker}, {total} % of a core in all", flush=True)
    return {"executor": name, "workers": per_worker, "cpu_pct_total": total}


def write_report(results: list[dict], out: Path, args) -> str:
    base = results[0]["cpu_pct_total"]
    lines = [
        f"# Idle Ray workers per executor ({time.strftime('%Y-%m-%d')}, TP={args.tp}, demo model, "
        f"{args.window_s:.0f} s window after {args.requests} requests and {args.settle_s:.0f} s of quiet; "
        f"the daemon's canary every {args.probe_interval_s:g} s)",
        "",
        "| executor | CPU per worker (% of a core) | RSS per worker (MiB) | CPU in all | ratio to the V2 executor |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        cpu = " / ".join(f"{w['cpu_pct']}" for w in r["workers"].values())
        rss = " / ".join(f"{w['rss_mib']}" for w in r["workers"].values())
        ratio = f"{r['cpu_pct_total'] / base:.2f}×" if base > 0 else "n/a (baseline 0 %)"
        lines.append(f"| {r['executor']} | {cpu} | {rss} | {r['cpu_pct_total']} % | {ratio} |")
    text = "\n".join(lines) + "\n"
    (out / "executor-idle.md").write_text(text)
    return text


def main() -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--probe-interval-s", type=float, default=2.0, help="the daemon's canary interval (its default: 2 s)")
    parser.add_argument("--executors", nargs="+", choices=list(EXECUTORS), default=list(EXECUTORS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-executor-idle-"))
    head = RayHead(num_cpus=max(2, args.tp)).start()
    try:
        results = [measure(work, head, name, EXECUTORS[name], args) for name in args.executors]
    finally:
        inject.disconnect()
        head.stop()
    (args.out / "executor-idle.json").write_text(json.dumps(results, indent=2))
    print(write_report(results, args.out, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
