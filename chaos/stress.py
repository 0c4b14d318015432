"""Load through faults: many concurrent streams, several faults injected while they all run.

    python -m chaos.stress --streams 256 --faults ray_kill,kill_engine_core,sigstop_worker --out DIR

Starts a private Ray head and the daemon (as a user would) and computes the fault-free
reference of every distinct request. Then ``--streams`` clients send at once and keep sending
(each its own request again and again: completions and chat, streamed or not, four lengths;
one client in eight hangs up on its first request after a few tokens; a 503 is retried after
its ``Retry-After``)
while the faults are injected one after another, each once the previous recovery is READY
and the warm standby is prepared again. While each recovery runs it sends a burst of
new requests larger than the admission queue. What is checked, per request:

* it ends with exactly the fault-free text, finish reason and usage, or with a documented
  retriable error (HTTP 503 + ``Retry-After``, or a 503 error event on the stream);
* none is lost (every request has an outcome), none duplicated (no extra tokens), none still
  running past its deadline;
* a client that hung up had its engine request aborted: the engine's running + waiting
  count (``vllm:num_requests_*``) and the daemon's in-flight count drop by exactly those;
* the daemon's RSS and open fds before and after.

Writes ``stress-report.json`` and ``stress-report.md`` to ``--out``; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import re
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import httpx
import openai

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, RayHead
from chaos.load import RequestRecord, client, compare, specs, stream_one
from chaos.soak import proc_stats, stop_and_inspect

LENGTHS = (48, 160, 400, 800)
FAULTS = ("ray_kill", "kill_engine_core", "sigstop_worker")
HANG_UP_AFTER = 6  # chunks a hanging-up client reads first


def hangs_up(r: RequestRecord) -> bool:
    """One client in eight hangs up mid-stream (a streamed completion or chat)."""
    return r.stream and r.index % 16 in (0, 10)


def stress_specs(n: int) -> list[RequestRecord]:
    """``n`` mixed requests: the four kinds of ``specs(mixed=True)`` and four lengths."""
    out = specs(n, LENGTHS[0], mixed=True)
    for r in out:
        r.max_tokens = LENGTHS[(r.index // 4) % len(LENGTHS)]
    return out


def engine_requests(base_url: str) -> float:
    """The engine's running + waiting requests, from vLLM's own ``/metrics``."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total = 0.0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        total += sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))
    return total


class Stress:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.head = RayHead(num_cpus=max(2, args.tp)).start()
        self.daemon: Daemon | None = None
        config = {
            "engine": {"tensor_parallel_size": args.tp, "max_model_len": 1024},
            "ray": {"address": self.head.address},
            "supervisor": {"max_restarts": 20, "probe_interval_s": 1.0, "hang_timeout_s": 6.0, "probe_timeout_s": 5.0,
                           "restart_backoff_initial_s": 0.2, "admission_queue_size": args.queue},
        }
        try:
            self.daemon = Daemon(workdir, config, env=OPERATOR_ENV).start()
        except BaseException:
            self.head.stop()
            raise
        self.api: openai.AsyncOpenAI | None = None
        self.faults: list[dict[str, Any]] = []
        self.bursts: list[RequestRecord] = []

    # --- one request, as a client with a deadline that may hang up -------------------------

    async def one(self, r: RequestRecord, hang_up: bool) -> RequestRecord:
        task = asyncio.create_task(stream_one(self.api, "demo-tiny-llama", r))
        try:
            if hang_up:
                while len(r.chunk_times) < HANG_UP_AFTER and not task.done():
                    await asyncio.sleep(0.05)
                if not task.done():
                    task.cancel()  # closes the HTTP connection mid-stream
                    await asyncio.gather(task, return_exceptions=True)
                    r.outcome = "hung_up"
                    return r
            await asyncio.wait_for(asyncio.shield(task), self.args.deadline_s)
        except asyncio.TimeoutError:
            task.cancel()
            r.outcome, r.error = "past_deadline", f"still running after {self.args.deadline_s} s"
        return r

    def burst_specs(self) -> list[RequestRecord]:
        """The admission burst: more short non-streamed requests than the queue holds."""
        records = specs(self.args.queue + self.args.burst_extra, 16, offset=5)
        for r in records:
            r.stream = False
        return records

    async def client_loop(self, template: RequestRecord, sent: list[RequestRecord], stop: asyncio.Event) -> None:
        """One client: the same request again and again until ``stop`` (a hanging-up client
        hangs up on its first one); after a 503 it waits what ``Retry-After`` says, as a
        well-behaved client does."""
        first = True
        while not stop.is_set():
            r = copy.deepcopy(template)
            sent.append(r)
            await self.one(r, hang_up=first and hangs_up(template))
            first = False
            if r.outcome == "error":  # Retry-After when given in seconds, else a second
                retry = r.retry_after or ""
                await asyncio.sleep(float(retry) if retry.replace(".", "", 1).isdigit() else 1.0)

    async def burst(self) -> None:
        """The burst at once, while a recovery runs."""
        records = self.burst_specs()
        self.bursts += records
        await asyncio.gather(*(stream_one(self.api, "demo-tiny-llama", r) for r in records))

    # --- the faults -------------------------------------------------------------------------

    def inject(self, kind: str) -> dict:
        if kind == "ray_kill":
            return inject.kill_worker(self.head.address, rank=0)
        if kind == "kill_engine_core":
            return inject.kill_engine_core(self.daemon.proc.pid)
        if kind == "sigstop_worker":
            return inject.signal_worker(self.head.address, signal.SIGSTOP, rank=0)
        raise ValueError(kind)

    async def faults_during(self, sent: list[RequestRecord]) -> None:
        loop_status = lambda: asyncio.to_thread(self.daemon.status)  # noqa: E731
        for kind in self.args.faults:
            await asyncio.to_thread(self.daemon.wait_standby, "ready", 300)
            await asyncio.sleep(1.0)  # streams of the new generation under way
            running = sum(r.outcome == "pending" and len(r.chunk_times) > 0 for r in sent)
            before = (await loop_status())["generation"]
            info = await asyncio.to_thread(self.inject, kind)
            row = {"fault": kind, "streams_running": running, "target": {k: v for k, v in info.items() if k != "monotonic"}}
            deadline = time.monotonic() + 60
            while (s := await loop_status())["state"] == "ready" and s["generation"] == before:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} was not detected within 60 s")
                await asyncio.sleep(0.05)
            burst = asyncio.create_task(self.burst())
            s = await asyncio.to_thread(self.daemon.wait_generation, before + 1, 300)
            await burst
            rec = [r for r in s["recoveries"] if r["from_generation"] >= before][0]
            row.update(detect_ms=round((rec["detected_monotonic"] - info["monotonic"]) * 1000, 1),
                       recovery_s=round(rec["ready_monotonic"] - info["monotonic"], 2),
                       standby=rec.get("standby"), reason=rec["reason"])
            self.faults.append(row)
            print(f"  {kind}: {running} streams running; detected in {row['detect_ms']} ms, "
                  f"READY {row['recovery_s']} s after ({rec['reason']}, {rec.get('standby')})", flush=True)

    # --- client hang-ups: the engine's own request count --------------------------------------

    async def hang_up_check(self) -> dict[str, Any]:
        """16 long streams; 8 clients hang up: the engine's running + waiting count and the
        daemon's in-flight count must drop by 8 while the other 8 still run."""
        records = specs(16, LENGTHS[-1], offset=3)
        tasks = [asyncio.create_task(stream_one(self.api, "demo-tiny-llama", r)) for r in records]
        deadline = time.monotonic() + 120
        while not all(len(r.chunk_times) >= HANG_UP_AFTER for r in records):
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                raise RuntimeError(f"the hang-up check's streams did not start: {[r.error for r in records if r.error]}")
            await asyncio.sleep(0.05)
        engine_before = await asyncio.to_thread(engine_requests, self.daemon.base_url)
        for t in tasks[:8]:
            t.cancel()
        deadline = time.monotonic() + 10
        while True:
            engine_now = await asyncio.to_thread(engine_requests, self.daemon.base_url)
            in_flight = (await asyncio.to_thread(self.daemon.status))["in_flight"]
            if (engine_now == 8 and in_flight == 8) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        still_running = sum(not t.done() for t in tasks[8:])
        for t in tasks[8:]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {"engine_before": engine_before, "engine_after": engine_now, "daemon_in_flight_after": in_flight,
                "others_still_running": still_running, "ok": engine_now == 8 and in_flight == 8 and still_running == 8}

    # --- the run --------------------------------------------------------------------------

    async def load(self) -> dict[str, Any]:
        self.api = client(self.daemon.base_url, timeout_s=self.args.deadline_s + 60)
        try:
            records = stress_specs(self.args.streams)
            distinct = list({r.key: r for r in records}.values())
            started = time.monotonic()
            ref_records = copy.deepcopy(distinct)
            await asyncio.gather(*(stream_one(self.api, "demo-tiny-llama", r) for r in ref_records))
            bad = [(r.index, r.error) for r in ref_records if r.outcome != "ok"]
            if bad:
                raise RuntimeError(f"the fault-free reference run failed: {bad[:5]}")
            reference = {r.key: r for r in ref_records}
            reference_s = time.monotonic() - started
            burst_ref = self.burst_specs()
            await asyncio.gather(*(stream_one(self.api, "demo-tiny-llama", r) for r in burst_ref))
            reference.update({r.key: r for r in burst_ref})
            print(f"reference: {len(ref_records)} distinct requests in {reference_s:.1f} s", flush=True)

            hang_ups = await self.hang_up_check()
            print(f"hang-ups: {hang_ups}", flush=True)
            before = proc_stats(self.daemon.proc.pid)
            started = time.monotonic()
            stop = asyncio.Event()
            sent: list[RequestRecord] = []
            clients = [asyncio.create_task(self.client_loop(t, sent, stop)) for t in records]
            deadline = time.monotonic() + 120
            while sum(len(r.chunk_times) >= 2 for r in sent) < len(records) // 2:
                if time.monotonic() > deadline:
                    stop.set()
                    raise RuntimeError(f"the load did not start: {[r.error for r in sent if r.error][:5]}")
                await asyncio.sleep(0.05)
            await self.faults_during(sent)
            await asyncio.sleep(self.args.settle_s)  # the last recovery's streams run on
            stop.set()
            await asyncio.gather(*clients)
            records = sent
            load_s = time.monotonic() - started
            await asyncio.sleep(3.0)  # the daemon's post-recovery gc runs 2 s in
            after = proc_stats(self.daemon.proc.pid)
            return self.outcomes(records, reference, hang_ups, before, after, load_s)
        finally:
            await self.api.close()

    def outcomes(self, records, reference, hang_ups, before, after, load_s) -> dict[str, Any]:
        finished = [r for r in records if r.outcome in ("ok", "error")]
        summary = compare([r for r in finished if r.outcome == "ok"], reference)
        retriable = [r for r in finished if r.outcome == "error" and "503" in f"{r.status} {r.error}"]
        other_errors = [r for r in finished if r.outcome == "error" and r not in retriable]
        burst_ok = [r for r in self.bursts if r.outcome == "ok"]
        burst_503 = [r for r in self.bursts if r.status == 503]
        burst_summary = compare(burst_ok, reference)
        return {
            "clients": self.args.streams, "requests": len(records), "load_s": round(load_s, 1),
            "ok_exact": summary["ok"] - summary["mismatched"], "mismatched": summary["mismatched"],
            "tokens_duplicated": summary["tokens_duplicated"], "diffs": summary["diffs"],
            "retriable_errors": len(retriable), "other_errors": [(r.index, r.status, r.error) for r in other_errors][:10],
            "hung_up": sum(r.outcome == "hung_up" for r in records),
            "past_deadline": sum(r.outcome == "past_deadline" for r in records),
            "lost": sum(r.outcome == "pending" for r in records),
            "bursts": {"sent": len(self.bursts), "ok_exact": len(burst_ok) - burst_summary["mismatched"],
                       "mismatched": burst_summary["mismatched"], "rejected_503": len(burst_503),
                       "rejected_with_retry_after": sum(bool(r.retry_after) for r in burst_503),
                       "other": [(r.status, r.error) for r in self.bursts if r.outcome != "ok" and r.status != 503][:5]},
            "hang_up_check": hang_ups,
            "daemon_before": before, "daemon_after": after,
        }

    def close(self) -> dict[str, Any]:
        if self.daemon.proc.poll() is not None:  # it failed: nothing to stop cleanly
            self.daemon.kill()
            self.head.stop()
            return {"exit_code": self.daemon.proc.returncode, "stop_s": 0, "left_after_stop": "daemon had exited",
                    "cluster_after_stop": {}}
        return stop_and_inspect(self.daemon, self.head)


def failures(report: dict[str, Any]) -> list[str]:
    """What the run must not show; empty when every check passed."""
    o, out = report["outcome"], []
    for key in ("mismatched", "tokens_duplicated", "past_deadline", "lost"):
        if o[key]:
            out.append(f"{key}: {o[key]}")
    if o["other_errors"]:
        out.append(f"errors that are not the documented retriable 503: {o['other_errors']}")
    b = o["bursts"]
    if b["mismatched"] or b["other"] or b["rejected_with_retry_after"] != b["rejected_503"]:
        out.append(f"admission burst: {b}")
    if not o["hang_up_check"]["ok"]:
        out.append(f"hung-up clients not aborted in the engine: {o['hang_up_check']}")
    if len(report["faults"]) != len(report["faults_planned"]):
        out.append(f"faults injected {len(report['faults'])} of {len(report['faults_planned'])}")
    c = report["close"]
    if c["exit_code"] != 0 or c["left_after_stop"] != "none" or c["cluster_after_stop"] != {"placement_groups": [], "actors": []}:
        out.append(f"stop: {c}")
    return out


def render_markdown(report: dict[str, Any]) -> str:
    o, b = report["outcome"], report["outcome"]["bursts"]
    before, after = o["daemon_before"], o["daemon_after"]
    lines = [
        f"# Load through faults ({report['started']}, {o['clients']} concurrent clients, TP={report['tp']})", "",
        f"- {o['clients']} clients sending at once and again (completions and chat, streamed and not, "
        f"{'/'.join(map(str, LENGTHS))} tokens): {o['requests']} requests in {o['load_s']} s",
        f"- outcomes: **{o['ok_exact']} exact**, {o['retriable_errors']} retriable 503, {o['hung_up']} hung up by their client, "
        f"{o['mismatched']} mismatched, {o['tokens_duplicated']} tokens duplicated, {o['past_deadline']} past the "
        f"{report['deadline_s']} s deadline, {o['lost']} lost, other errors: {o['other_errors'] or 'none'}",
        f"- admission bursts during the recoveries (queue {report['queue']}): {b['sent']} sent, {b['ok_exact']} served exactly, "
        f"{b['rejected_503']} rejected with 503 ({b['rejected_with_retry_after']} with `Retry-After`), other: {b['other'] or 'none'}",
        f"- client hang-ups: engine running + waiting {o['hang_up_check']['engine_before']:g} → "
        f"{o['hang_up_check']['engine_after']:g} after 8 of 16 clients hung up; daemon in flight "
        f"{o['hang_up_check']['daemon_in_flight_after']}",
        f"- daemon before → after the load: RSS {before['rss_kib'] // 1024} → {after['rss_kib'] // 1024} MiB, "
        f"fds {before['fds']} → {after['fds']}, threads {before['threads']} → {after['threads']}",
        f"- stop: exit {report['close']['exit_code']} in {report['close']['stop_s']} s; left behind: "
        f"{report['close']['left_after_stop']}", "",
        "| fault | streams running at the fault | detected | READY after | reason | standby |", "| - | - | - | - | - | - |",
        *[f"| {f['fault']} | {f['streams_running']} | {f['detect_ms']} ms | {f['recovery_s']} s | {f['reason']} | "
          f"{(f.get('standby') or {}).get('result', '–')} |" for f in report["faults"]],
    ]
    fails = failures(report)
    lines += ["", f"**Checks: {'all passed' if not fails else 'FAILED: ' + '; '.join(fails)}**"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.stress")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--faults", type=lambda s: s.split(","), default=list(FAULTS))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--queue", type=int, default=64, help="the daemon's admission_queue_size")
    parser.add_argument("--settle-s", type=float, default=5.0, help="load kept on after the last recovery")
    parser.add_argument("--burst-extra", type=int, default=16, help="burst = queue + this, during each recovery")
    parser.add_argument("--deadline-s", type=float, default=600.0, help="a request still running after this is hung")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args(argv)
    bad = [f for f in args.faults if f not in FAULTS]
    if bad:
        parser.error(f"unknown fault(s) {bad}; known: {', '.join(FAULTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tp": args.tp,
                              "queue": args.queue, "deadline_s": args.deadline_s, "faults_planned": args.faults}
    stress = Stress(args, Path(tempfile.mkdtemp(prefix="chaos-stress-")))
    try:
        stress.daemon.wait_ready()
        inject.prepare(stress.head.address)
        report["outcome"] = asyncio.run(stress.load())
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        report["faults"] = stress.faults
        report["close"] = stress.close()
    (args.out / "stress-report.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "stress-report.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 1 if failures(report) else 0


if __name__ == "__main__":
    sys.exit(main())
