"""What clients see when a worker dies under steady streaming load: 1 replica vs 2 replicas
(live stream migration), and how soon the killed replica's capacity is back with the warm
standby vs a cold rebuild (``--standby none``), in one run on one machine, on the same Ray head.

``--clients`` clients each stream completions one after another (openai SDK, greedy, fixed
length) for the whole run. After a warm-up, a worker of replica 0 is ``ray.kill``ed; the load
goes on until that replica serves again, plus a cool-down. Repeated ``--kills`` times per
configuration. Reported per configuration:

* the largest gap each client saw between two chunks, or between sending a request and its
  first chunk, in the window from the kill until the replica is back (p50 / p99 / max over
  clients and kills);
* requests failed (an error after the response started, or a 5xx) and rejected (503 at admission);
* texts that differ from the fault-free reference of the same prompt;
* chunks per second during the recovery window vs the warm-up before the kill;
* when the killed replica served again (capacity back), and whether its rebuild adopted the
  warm standby.

Configurations (``--configs``): ``1`` (one replica, warm standby), ``2`` (two replicas, warm
standby), ``2-cold`` (two replicas, ``--standby none``).

    python -m bench.migration --clients 16 --tokens 200 --kills 2
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import MODEL_NAME, base_parser, gaps_in, p99, start_daemon
from chaos import inject
from chaos.harness import Daemon, RayHead
from chaos.load import PROMPTS, RequestRecord, client, compare, stream_one


def replicas(daemon: Daemon) -> list[dict]:
    return daemon.status()["replicas"]


async def load(base_url: str, clients: int, tokens: int, stop: asyncio.Event) -> list[RequestRecord]:
    """``clients`` loops, each streaming one request after another until ``stop``."""
    api = client(base_url)
    records: list[RequestRecord] = []

    async def loop(i: int) -> None:
        n = 0
        while not stop.is_set():
            r = RequestRecord(i, PROMPTS[(i + n) % len(PROMPTS)], tokens)
            records.append(await stream_one(api, MODEL_NAME, r))
            n += 1

    try:
        await asyncio.gather(*(loop(i) for i in range(clients)))
    finally:
        await api.close()
    return records


def chunks_per_s(records: list[RequestRecord], start: float, end: float) -> float:
    return sum(1 for r in records for t in r.chunk_times if start <= t <= end) / max(end - start, 1e-9)


LABELS = {"1": "1 replica (warm standby)", "2": "2 replicas (live migration, warm standby)",
          "2-cold": "2 replicas (live migration, `--standby none`: cold rebuild)"}


def one_config(work: Path, head: RayHead, config: str, args: Any) -> dict[str, Any]:
    n_replicas, standby = int(config.split("-")[0]), "none" if config.endswith("-cold") else "warm"
    (work / f"c{config}").mkdir(exist_ok=True)
    daemon = start_daemon(work / f"c{config}", head, tp=1, replicas=n_replicas, max_restarts=50, standby=standby)
    try:
        daemon.wait_ready(timeout_s=600)
        daemon.wait_replicas_serving(timeout_s=600)
        inject.prepare(head.address)
        # the fault-free reference: every prompt once, all replicas serving
        ref_records = asyncio.run(_reference(daemon.base_url, args.tokens))
        reference = {r.key: r for r in ref_records}
        kills = []
        for k in range(args.kills):
            if standby == "warm":  # the warm standby (the default) ready, as in steady state
                daemon.wait_standby()
            kills.append(asyncio.run(_kill_under_load(daemon, head, args, reference)))
            print(f"config={config} kill {k + 1}: {json.dumps({x: y for x, y in kills[-1].items() if x != 'gaps'})}",
                  flush=True)
        return {"config": config, "replicas": n_replicas, "standby": standby, "kills": kills}
    finally:
        daemon.stop()
        inject.disconnect()


async def _reference(base_url: str, tokens: int) -> list[RequestRecord]:
    api = client(base_url)
    try:
        return list(await asyncio.gather(*(stream_one(api, MODEL_NAME, RequestRecord(i, p, tokens))
                                           for i, p in enumerate(PROMPTS))))
    finally:
        await api.close()


async def _kill_under_load(daemon: Daemon, head: RayHead, args: Any, reference: dict) -> dict[str, Any]:
    stop = asyncio.Event()
    task = asyncio.create_task(load(daemon.base_url, args.clients, args.tokens, stop))
    warm_from = time.monotonic()
    await asyncio.sleep(args.warmup_s)
    before = {r["replica"]: r["generation"] for r in replicas(daemon)}
    victim = replicas(daemon)[0]["instance_id"]
    info = await asyncio.to_thread(inject.kill_worker, head.address, 0, victim)
    killed_at = info["monotonic"]
    await asyncio.to_thread(daemon.wait_replicas_serving, {0: before[0]}, 600)
    back_at = time.monotonic()
    await asyncio.sleep(args.cooldown_s)
    stop.set()
    records = await task
    summary = compare(records, reference)
    rejected = sum(1 for r in records if r.outcome != "ok" and r.status == 503 and not r.chunk_times)
    gaps = gaps_in(records, killed_at, back_at, args.clients)
    return {
        "requests": len(records), "failed": summary["failed"] - rejected, "rejected": rejected,
        "mismatched": summary["mismatched"], "recovery_s": round(back_at - killed_at, 2),
        "gap_p50_s": round(statistics.median(gaps), 3), "gap_max_s": round(max(gaps), 3),
        "chunks_per_s_before": round(chunks_per_s(records, warm_from + 2, killed_at), 1),
        "chunks_per_s_during": round(chunks_per_s(records, killed_at, back_at), 1),
        "gaps": [round(g, 3) for g in gaps],
        "standby_result": ((daemon.status()["recoveries"] or [{}])[-1].get("standby") or {}).get("result", "none"),
    }


def write_report(results: list[dict], out: Path, args: Any) -> str:
    lines = [f"Live stream migration, {time.strftime('%Y-%m-%d')}: demo model on CPU (2 cores), TP=1 per replica, "
             f"{args.clients} clients streaming {args.tokens}-token completions back to back; one `ray.kill` of a "
             f"worker of replica 0 per round, {args.kills} round(s) per configuration, one run on one machine.", "",
             "| configuration | largest gap per client p50 / p99 / max (s) | failed | rejected | texts differing | "
             "chunks/s during recovery / before | replica back after (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        ks = res["kills"]
        gaps = [g for k in ks for g in k["gaps"]]
        ratio = statistics.median(k["chunks_per_s_during"] / max(k["chunks_per_s_before"], 1e-9) for k in ks)
        label = LABELS.get(res.get("config", str(res["replicas"])), res.get("config"))
        lines.append(f"| {label} | {statistics.median(gaps):.2f} / {p99(gaps):.2f} / {max(gaps):.2f} | "
                     f"{sum(k['failed'] for k in ks)} | {sum(k['rejected'] for k in ks)} | {sum(k['mismatched'] for k in ks)} | "
                     f"{ratio:.2f} | {statistics.median(k['recovery_s'] for k in ks):.1f} |")
    by = {r.get("config", str(r["replicas"])): r for r in results}
    one, many, cold = by.get("1"), by.get("2"), by.get("2-cold")
    if one and many:
        g1 = p99([g for k in one["kills"] for g in k["gaps"]])
        g2 = p99([g for k in many["kills"] for g in k["gaps"]])
        lines += ["", f"- p99 largest gap, 2 replicas / 1 replica: **{g2 / g1:.3f}** (goal: p99 ≤ 1 s, 0 failed, 0 rejected)"]
    if many and cold:
        warm_s = statistics.median(k["recovery_s"] for k in many["kills"])
        cold_s = statistics.median(k["recovery_s"] for k in cold["kills"])
        adopted = [k.get("standby_result") for k in many["kills"]]
        lines += [f"- a killed replica's capacity back, warm standby / cold rebuild: {warm_s:.1f} / {cold_s:.1f} s = "
                  f"**{warm_s / cold_s:.2f}×** (goal ≤ 0.3×); the warm rebuilds: {', '.join(adopted)}"]
    text = "\n".join(lines) + "\n"
    (out / "migration.md").write_text(text)
    return text


def main() -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--cooldown-s", type=float, default=3.0)
    parser.add_argument("--configs", nargs="+", default=["1", "2", "2-cold"], choices=sorted(LABELS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-migration-"))
    head = RayHead(num_cpus=2).start()
    results = []
    try:
        for config in args.configs:
            results.append(one_config(work, head, config, args))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        inject.disconnect()
        head.stop()
    (args.out / "migration.json").write_text(json.dumps(results, indent=2))
    print(write_report(results, args.out, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
