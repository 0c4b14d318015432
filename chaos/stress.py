"""Load through faults: many concurrent streams, several faults injected while they all run.

    python -m chaos.stress --streams 256 --faults ray_kill,kill_engine_core,sigstop_worker --out DIR

Starts a private Ray head and the daemon (as a user would) and computes the fault-free
reference of every distinct request. Then ``--streams`` clients send at once and keep sending
(each its own request again and again: completions and chat, streamed or not, four lengths;
one client in eight hangs up on its first request after a few tokens; a 503 is retried after
its ``Retry-After``)
while the faults are injected one after another, each once the previous recovery is READY
and the warm standby is prepared again. While each recovery runs it sends a burst of
new requests larger than the admission queue, and hangs up a few of the streams the fault
parked. What is checked (``failures``):

* every request ends with exactly the fault-free text, finish reason and usage, or is rejected
  retriably: an HTTP 503 with ``Retry-After`` before any token (``classify``). A stream that
  delivered tokens and then ends in an error (a 503 error event included) is a failure;
* at least ``MIN_EXACT`` of the requests (less those whose client hung up) are exact, at most
  ``MAX_RETRIABLE`` are retriable rejections;
* none lost (a request sent whose client task never recorded its outcome), none duplicated
  (no extra tokens), none still running past its deadline; the daemon counts as served
  (``ok`` + ``continued``) exactly the requests the clients read whole;
* the admission limit was reached: the bursts got at least ``--burst-extra`` 503s, each with
  ``Retry-After``, and every admitted burst request was served exactly;
* each recovery's reason is the fault's (``EXPECTED_REASON``);
* hang-ups: fault-free, the engine's running + waiting count (``vllm:num_requests_*``) and the
  daemon's in-flight count drop by exactly the clients that hung up; under faults, the
  daemon's parked count drops by exactly the parked streams whose client hung up during the
  recovery; after the load, nothing is left in flight, parked, queued or in the engine;
* the daemon's RSS, open fds and threads grow by at most ``MAX_GROWTH``.

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
HANG_UPS_PER_FAULT = 4  # parked streams whose client hangs up during each recovery
EXPECTED_REASON = {"ray_kill": "worker_death", "kill_engine_core": "engine_dead", "sigstop_worker": "hang"}
MIN_EXACT = 0.9  # of the requests not hung up by their client (measured: 99.8 % at 64 clients, 100 % at 256)
MAX_RETRIABLE = 0.05  # of the requests (measured: 0.2 % and 0)
MAX_GROWTH = {"rss_kib": 256 * 1024, "fds": 64, "threads": 16}  # the daemon's, over the load (measured: +24 MiB, -10 fds, +2)


def classify(r: RequestRecord) -> str:
    """One request's outcome: ``ok`` (then compared with the reference), ``retriable`` (an HTTP
    503 with ``Retry-After`` before any token), ``hung_up``, ``past_deadline``, or a failure:
    ``failed_after_tokens`` (an error after the stream delivered something, a 503 error event
    included) or ``failed`` (any other error: another status, an error event before any token,
    a 503 without ``Retry-After``, a broken connection), or ``pending`` (no outcome: lost)."""
    if r.outcome != "error":
        return r.outcome
    if r.text or r.token_ids:
        return "failed_after_tokens"
    if r.status == 503 and not r.chunk_times and r.retry_after and r.retry_after.strip().isdigit():
        return "retriable"
    return "failed"


def hangs_up(r: RequestRecord) -> bool:
    """One client in eight hangs up mid-stream (a streamed completion or chat)."""
    return r.stream and r.index % 16 in (0, 10)


def stress_specs(n: int) -> list[RequestRecord]:
    """``n`` mixed requests: the four kinds of ``specs(mixed=True)`` and four lengths."""
    out = specs(n, LENGTHS[0], mixed=True)
    for r in out:  # a hanging-up client's request is long: it cannot end before the client hangs up
        r.max_tokens = LENGTHS[-1] if hangs_up(r) else LENGTHS[(r.index // 4) % len(LENGTHS)]
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
        self.launched = 0  # client requests sent (a record that never gets an outcome is lost)
        self.tasks: dict[int, asyncio.Task] = {}  # id(record) -> its request, while it runs

    # --- one request, as a client with a deadline that may hang up -------------------------

    async def one(self, r: RequestRecord, hang_up: bool) -> RequestRecord:
        """``r`` sent; hung up after ``HANG_UP_AFTER`` chunks when ``hang_up``, or when a
        recovery cancels its task (``hang_up_parked``)."""
        task = asyncio.create_task(stream_one(self.api, "demo-tiny-llama", r))
        self.tasks[id(r)] = task
        try:
            if hang_up:
                while len(r.chunk_times) < HANG_UP_AFTER and not task.done():
                    await asyncio.sleep(0.05)
                if not task.done():
                    task.cancel()  # closes the HTTP connection mid-stream
            await asyncio.wait({task}, timeout=self.args.deadline_s)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                r.outcome, r.error = "past_deadline", f"still running after {self.args.deadline_s} s"
            elif task.cancelled():
                r.outcome = "hung_up"
        finally:
            self.tasks.pop(id(r), None)
        return r

    def burst_specs(self) -> list[RequestRecord]:
        """The admission burst: more short non-streamed requests than the queue holds."""
        records = specs(self.args.queue + self.args.burst_extra, 16, offset=5)
        for r in records:
            r.stream = False
        return records

    async def client_loop(self, template: RequestRecord, sent: list[RequestRecord], done: list[RequestRecord],
                          stop: asyncio.Event) -> None:
        """One client: the same request again and again until ``stop`` (a hanging-up client
        hangs up on its first one); after a 503 it waits what ``Retry-After`` says, as a
        well-behaved client does. ``sent`` gets each request as it is sent, ``done`` once it
        has its outcome."""
        first = True
        while not stop.is_set():
            r = copy.deepcopy(template)
            sent.append(r)
            self.launched += 1
            await self.one(r, hang_up=first and hangs_up(template))
            if r.outcome != "pending":
                done.append(r)
            first = False
            if r.outcome == "error":  # Retry-After when given in seconds, else a second
                retry = r.retry_after or ""
                await asyncio.sleep(float(retry) if retry.replace(".", "", 1).isdigit() else 1.0)

    async def burst(self) -> list[RequestRecord]:
        """The burst at once, while a recovery runs."""
        records = self.burst_specs()
        self.bursts += records
        await asyncio.gather(*(stream_one(self.api, "demo-tiny-llama", r) for r in records))
        return records

    async def hang_up_parked(self, sent: list[RequestRecord]) -> dict[str, Any]:
        """During a recovery: ``HANG_UPS_PER_FAULT`` clients whose stream the fault parked
        (tokens received, far from its end) hang up; the daemon's parked count must drop by
        exactly those while it is still recovering (nothing else leaves the parked set then)."""
        seen, deadline = [], time.monotonic() + 1.5
        while time.monotonic() < deadline:  # the interrupted streams park: until their count holds 0.3 s
            s = await asyncio.to_thread(self.daemon.status)
            seen.append((time.monotonic(), s["parked"]))
            if s["state"] == "ready" or (seen[0][0] < seen[-1][0] - 0.3 and {p for t, p in seen if t >= seen[-1][0] - 0.3} == {s["parked"]}):
                break
            await asyncio.sleep(0.05)
        # Parked streams with tokens, those farthest from their end first (a parked stream cannot
        # finish while the daemon recovers, so any of them is a fair pick; a mid-stream one is the
        # usual case, but which streams run at a fault is chance).
        picked = sorted((r for r in sent if r.stream and r.outcome == "pending" and id(r) in self.tasks
                         and 0 < len(r.chunk_times) < r.max_tokens),
                        key=lambda r: len(r.chunk_times) / r.max_tokens)[:HANG_UPS_PER_FAULT]
        row: dict[str, Any] = {"hung_up": len(picked), "state_before": s["state"], "parked_before": s["parked"]}
        for r in picked:
            self.tasks[id(r)].cancel()
        deadline = time.monotonic() + 3.0
        while True:
            s = await asyncio.to_thread(self.daemon.status)
            if s["parked"] <= row["parked_before"] - len(picked) or s["state"] == "ready" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        row.update(state_after=s["state"], parked_after=s["parked"])
        row["ok"] = (len(picked) == HANG_UPS_PER_FAULT and row["state_before"] != "ready" and s["state"] != "ready"
                     and s["parked"] == row["parked_before"] - len(picked))
        return row

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
            row["hang_ups"] = await self.hang_up_parked(sent)
            s = await asyncio.to_thread(self.daemon.wait_generation, before + 1, 300)
            records = await burst
            rejected = [r for r in records if r.status == 503]
            row["burst"] = {"sent": len(records), "ok": sum(r.outcome == "ok" for r in records),
                            "rejected_503": len(rejected), "with_retry_after": sum(bool(r.retry_after) for r in rejected)}
            rec = [r for r in s["recoveries"] if r["from_generation"] >= before][0]
            row.update(detect_ms=round((rec["detected_monotonic"] - info["monotonic"]) * 1000, 1),
                       recovery_s=round(rec["ready_monotonic"] - info["monotonic"], 2),
                       standby=rec.get("standby"), reason=rec["reason"])
            self.faults.append(row)
            print(f"  {kind}: {running} streams running; detected in {row['detect_ms']} ms, "
                  f"READY {row['recovery_s']} s after ({rec['reason']}, {rec.get('standby')}); "
                  f"burst {row['burst']}; hang-ups {row['hang_ups']}", flush=True)

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
            counted_before = (await asyncio.to_thread(self.daemon.status))["requests"]
            started = time.monotonic()
            stop = asyncio.Event()
            sent: list[RequestRecord] = []
            done: list[RequestRecord] = []
            clients = [asyncio.create_task(self.client_loop(t, sent, done, stop)) for t in records]
            deadline = time.monotonic() + 120
            while sum(len(r.chunk_times) >= 2 for r in sent) < len(records) // 2:
                if time.monotonic() > deadline:
                    stop.set()
                    raise RuntimeError(f"the load did not start: {[r.error for r in sent if r.error][:5]}")
                await asyncio.sleep(0.05)
            try:
                await self.faults_during(sent)
                await asyncio.sleep(self.args.settle_s)  # the last recovery's streams run on
            finally:
                stop.set()
                crashed = [repr(e) for e in await asyncio.gather(*clients, return_exceptions=True) if e is not None]
            load_s = time.monotonic() - started
            idle = await self.quiescence()
            await asyncio.sleep(max(0.0, 3.0 - idle["after_s"]))  # the daemon's post-recovery gc runs 2 s in
            after = proc_stats(self.daemon.proc.pid)
            counted = {k: v - counted_before.get(k, 0) for k, v in idle.pop("requests").items()}
            return self.outcomes(sent, done, crashed, reference, hang_ups, before, after, load_s, idle, counted)
        finally:
            await self.api.close()

    async def quiescence(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """After the load: nothing in flight, parked or queued in the daemon, nothing running
        or waiting in the engine (a hung-up request left running would show here)."""
        started = time.monotonic()
        while True:
            s = await asyncio.to_thread(self.daemon.status)
            engine = await asyncio.to_thread(engine_requests, self.daemon.base_url)
            idle = {"in_flight": s["in_flight"], "parked": s["parked"], "admission_queue": s["admission_queue"],
                    "engine_running_waiting": engine}
            if not any(idle.values()) or time.monotonic() - started > timeout_s:
                return {**idle, "ok": not any(idle.values()), "after_s": round(time.monotonic() - started, 1),
                        "requests": s["requests"]}
            await asyncio.sleep(0.2)

    def outcomes(self, sent, done, crashed, reference, hang_ups, before, after, load_s, idle, counted) -> dict[str, Any]:
        kinds = {id(r): classify(r) for r in sent}
        of = lambda kind: [r for r in sent if kinds[id(r)] == kind]  # noqa: E731
        summary = compare(of("ok"), reference)
        failed = of("failed_after_tokens") + of("failed")
        burst_kinds = [classify(r) for r in self.bursts]
        burst_ok = [r for r, k in zip(self.bursts, burst_kinds) if k == "ok"]
        burst_503 = [r for r in self.bursts if r.status == 503]
        burst_summary = compare(burst_ok, reference)
        served = sum(counted.get(k, 0) for k in ("ok", "continued"))
        return {
            "clients": self.args.streams, "requests": len(sent), "load_s": round(load_s, 1),
            "ok_exact": summary["ok"] - summary["mismatched"], "mismatched": summary["mismatched"],
            "tokens_duplicated": summary["tokens_duplicated"], "diffs": summary["diffs"],
            "retriable_errors": len(of("retriable")),
            "failed_after_tokens": len(of("failed_after_tokens")),
            "other_errors": [(r.index, r.status, r.retry_after, len(r.text), r.error) for r in failed][:10],
            "hung_up": len(of("hung_up")), "hung_up_in_recovery": sum(f["hang_ups"]["hung_up"] for f in self.faults),
            "past_deadline": len(of("past_deadline")),
            "lost": self.launched - len(done) + sum(k == "pending" for k in burst_kinds),
            "clients_crashed": crashed[:5],
            "daemon_counted": counted, "daemon_served": served,
            "clients_read_whole": summary["ok"] + len(burst_ok),
            "bursts": {"sent": len(self.bursts), "ok_exact": len(burst_ok) - burst_summary["mismatched"],
                       "mismatched": burst_summary["mismatched"], "rejected_503": len(burst_503),
                       "rejected_with_retry_after": sum(k == "retriable" for k in burst_kinds),
                       "other": [(r.status, r.retry_after, r.error) for r, k in zip(self.bursts, burst_kinds)
                                 if k not in ("ok", "retriable")][:5]},
            "hang_up_check": hang_ups, "after_load": idle,
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
    out: list[str] = []
    if len(report["faults"]) != len(report["faults_planned"]):
        out.append(f"faults injected {len(report['faults'])} of {len(report['faults_planned'])}")
    o = report.get("outcome")
    if o is None:
        out.append("no outcome: the load did not run to its end")
    else:
        out += outcome_failures(report, o)
    for f in report["faults"]:
        if f["reason"] != EXPECTED_REASON[f["fault"]]:
            out.append(f"{f['fault']} recovered as {f['reason']!r}, not {EXPECTED_REASON[f['fault']]!r}")
        if f["streams_running"] <= 0:
            out.append(f"{f['fault']}: no stream was running at the fault")
        if not f["hang_ups"]["ok"]:
            out.append(f"{f['fault']}: clients that hung up while parked were not dropped by the daemon: {f['hang_ups']}")
    c = report["close"]
    if c["exit_code"] != 0 or c["left_after_stop"] != "none" or c["cluster_after_stop"] != {"placement_groups": [], "actors": []}:
        out.append(f"stop: {c}")
    return out


def outcome_failures(report: dict[str, Any], o: dict[str, Any]) -> list[str]:
    out = []
    for key in ("mismatched", "tokens_duplicated", "past_deadline", "lost", "failed_after_tokens", "clients_crashed"):
        if o[key]:
            out.append(f"{key}: {o[key]}")
    if o["other_errors"]:
        out.append(f"errors that are not a 503 + Retry-After before any token: {o['other_errors']}")
    counted = o["requests"] - o["hung_up"]
    if o["ok_exact"] < MIN_EXACT * counted:
        out.append(f"exact answers {o['ok_exact']} of {counted} (not hung up), below the floor {MIN_EXACT:.0%}")
    if o["retriable_errors"] > MAX_RETRIABLE * o["requests"]:
        out.append(f"retriable rejections {o['retriable_errors']} of {o['requests']}, above the cap {MAX_RETRIABLE:.0%}")
    if o["daemon_served"] != o["clients_read_whole"]:
        out.append(f"the daemon served {o['daemon_served']} requests, the clients read {o['clients_read_whole']} whole: "
                   f"{o['daemon_counted']}")
    b = o["bursts"]
    if b["mismatched"] or b["other"] or b["rejected_with_retry_after"] != b["rejected_503"]:
        out.append(f"admission burst: {b}")
    if b["rejected_503"] < report.get("burst_extra", 1) or b["ok_exact"] < report.get("queue", 1):
        out.append(f"the admission limit was not reached ({b['rejected_503']} rejected, at least "
                   f"{report.get('burst_extra', 1)} wanted) or admitted too little ({b['ok_exact']} served, at least "
                   f"{report.get('queue', 1)} wanted): {b}")
    if not o["hang_up_check"]["ok"]:
        out.append(f"hung-up clients not aborted in the engine: {o['hang_up_check']}")
    if not o["after_load"]["ok"]:
        out.append(f"left after the load (hung-up requests not aborted?): {o['after_load']}")
    before, after = o["daemon_before"], o["daemon_after"]
    grown = {k: after[k] - before[k] for k in MAX_GROWTH if after[k] - before[k] > MAX_GROWTH[k]}
    if grown:
        out.append(f"the daemon grew over the load by {grown} (bound {MAX_GROWTH}): {before} -> {after}")
    return out


def render_markdown(report: dict[str, Any]) -> str:
    o, b = report["outcome"], report["outcome"]["bursts"]
    before, after = o["daemon_before"], o["daemon_after"]
    lines = [
        f"# Load through faults ({report['started']}, {o['clients']} concurrent clients, TP={report['tp']})", "",
        f"- {o['clients']} clients sending at once and again (completions and chat, streamed and not, "
        f"{'/'.join(map(str, LENGTHS))} tokens): {o['requests']} requests in {o['load_s']} s",
        f"- outcomes: **{o['ok_exact']} exact**, {o['retriable_errors']} rejected 503 + `Retry-After` before any token, "
        f"{o['hung_up']} hung up by their client ({o['hung_up_in_recovery']} while parked in a recovery), "
        f"{o['mismatched']} mismatched, {o['tokens_duplicated']} tokens duplicated, {o['failed_after_tokens']} failed "
        f"after tokens, {o['past_deadline']} past the {report['deadline_s']} s deadline, {o['lost']} lost, other errors: "
        f"{o['other_errors'] or 'none'}; the daemon counted {o['daemon_served']} served, the clients read "
        f"{o['clients_read_whole']} whole",
        f"- admission bursts during the recoveries (queue {report['queue']}): {b['sent']} sent, {b['ok_exact']} served exactly, "
        f"{b['rejected_503']} rejected with 503 ({b['rejected_with_retry_after']} with `Retry-After`), other: {b['other'] or 'none'}",
        f"- client hang-ups: engine running + waiting {o['hang_up_check']['engine_before']:g} → "
        f"{o['hang_up_check']['engine_after']:g} after 8 of 16 clients hung up; daemon in flight "
        f"{o['hang_up_check']['daemon_in_flight_after']}; after the load: {o['after_load']}",
        f"- daemon before → after the load: RSS {before['rss_kib'] // 1024} → {after['rss_kib'] // 1024} MiB, "
        f"fds {before['fds']} → {after['fds']}, threads {before['threads']} → {after['threads']}",
        f"- stop: exit {report['close']['exit_code']} in {report['close']['stop_s']} s; left behind: "
        f"{report['close']['left_after_stop']}", "",
        "| fault | streams running at the fault | detected | READY after | reason | standby | burst: ok / 503 | "
        "parked, hung up → parked |", "| - | - | - | - | - | - | - | - |",
        *[f"| {f['fault']} | {f['streams_running']} | {f['detect_ms']} ms | {f['recovery_s']} s | {f['reason']} | "
          f"{(f.get('standby') or {}).get('result', '–')} | {f['burst']['ok']} / {f['burst']['rejected_503']} | "
          f"{f['hang_ups']['parked_before']}, {f['hang_ups']['hung_up']} → {f['hang_ups']['parked_after']} |"
          for f in report["faults"]],
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
                              "queue": args.queue, "burst_extra": args.burst_extra, "deadline_s": args.deadline_s,
                              "faults_planned": args.faults}
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
