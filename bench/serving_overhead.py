"""Serving overhead: the daemon vs. ``vllm serve`` on the same model, executor and Ray cluster,
measured with the same client (``vllm bench serve``, random dataset, fixed seed), alternating
the servers several times. Prints per-metric ratios daemon / vllm serve.

Two modes:

- at a fixed rate (default ``--rate 16``, below what either server can do): what a client
  waits for (TTFT, ITL) when the server is not the bottleneck;
- ``--saturation``: capacity. No rate limit, ``--max-concurrency`` streams always in flight
  (8; 32 in / 64 out tokens): the request throughput each server sustains, and its CPU per
  generated token (its whole process tree and the Ray head's, over the run). The daemon runs
  twice here: with its defaults (the warm standby's processes beside the engine) and with
  ``standby = "none"``.

    python -m bench.serving_overhead --rounds 3
    python -m bench.serving_overhead --saturation --rounds 3

``--interleave``: the servers are started once and stay up side by side (on one Ray head), and
each round measures each of them in turn, the order reversed every other round (A B, B A, ...;
with three kinds or more, a Williams design, so that each kind takes each place: ``alternating``).
On a shared 2-core machine the capacity drifts by ±20 % over minutes; a round here takes
seconds, so each pair is measured close together in time. Each server's CPU count includes the
Ray head's processes, so the other servers' idle Ray workers too; the idle daemons beside it probe
and send a canary now and then where an idle ``vllm serve`` does nothing, a small bias in the
daemon's favour. vLLM's CPU worker binds its OpenMP threads by itself (``VLLM_CPU_OMP_THREADS_BIND=auto``):
with TP=1 on 2 cores every server's worker takes core 0 and leaves core 1 to the rest, so side by side
the servers' workers share one core, and a saturated one starves the other's (an idle daemon's canary
waited over 4 s for a step beside a saturated ``vllm serve``: a hang, and a rebuild, 2026-11-27).
Without ``--interleave`` only one server is up at a time, which is what the ``mp`` pair needs.

    python -m bench.serving_overhead --saturation --interleave --rounds 10 --num-prompts 200 \
        --kinds vllm_serve daemon_standby_none

``--interleave --alone``: as ``--interleave``, but every server other than the one measured is
stopped (SIGSTOP: its own processes and the Ray workers that appeared while it started) over each
window, and the measured one is continued ``--thaw-s`` before it. Each window then runs as if its
server were alone on the host (its worker has core 0 to itself, no idle neighbour probes), while
a round's windows are about 40 s apart instead of 2.3 min: three to four times the rounds an hour.
It does not keep a round in one host state: this host's two speeds (the gauge's Python loop at
0.8-1.0 or 1.2-1.5 ms, every process's CPU per token 30-40 % apart) change within a minute, and 13
of the first 24 rounds mixed them (22 of 78 with a server started per window): ``bench.pooled
--same-state`` still sorts them.

    python -m bench.serving_overhead --saturation --interleave --alone --rounds 12 --client-nice -10 \
        --settle-s 60 --kinds vllm_serve daemon daemon_standby_none

``daemon_standby_frozen`` (with ``--interleave``): the defaults, but the ready standby's processes
stay stopped from the settle on, its own windows included; beside ``daemon`` and
``daemon_without_idle`` (no standby made, the serving worker made as by default) it splits the
standby's price into its running, its being there, and the way the serving worker was made.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import (
    HostSpeed, HostSteal, VllmServe, base_parser, bench_serve, host_work, spread, start_daemon, thread_schedstat, tree, tree_cpu_s,
)
from chaos import inject
from chaos.harness import RayHead
from supervisor.testhooks import ENV, STANDBY_WITHOUT_ENV

METRICS = [
    ("request_throughput", "request throughput", "higher"),
    ("output_throughput", "output token throughput", "higher"),
    ("p50_ttft_ms", "TTFT p50", "lower"),
    ("p99_ttft_ms", "TTFT p99", "lower"),
    ("p50_itl_ms", "ITL p50", "lower"),
    ("p99_itl_ms", "ITL p99", "lower"),
    ("cpu_ms_per_token", "CPU per output token (ms, whole tree)", "lower"),
    ("cpu_ms_per_token_front", "... of it in the front (the API server / the daemon)", "info"),
    ("cpu_ms_per_token_engine_core", "... in the engine core", "info"),
    ("cpu_ms_per_token_workers", "... in the workers", "info"),
    ("cpu_ms_per_token_rest", "... in the rest (Ray, helpers, an idle standby)", "info"),
    ("chunks_per_request", "stream chunks per request after the first", "info"),
    ("tokens_per_step", "tokens per engine step (vLLM's iteration_tokens)", "info"),
    ("step_ms", "wall time per engine step (ms)", "info"),
    ("loop_cpu_us_per_token", "the front's event-loop thread: CPU per output token (µs)", "info"),
    ("loop_wait_us_per_token", "... waiting for a core while runnable, per output token (µs)", "info"),
    ("loop_wait_us_per_run", "... that wait per time it was run (µs)", "info"),
    ("ttft_outside_ms", "mean TTFT outside vLLM's (HTTP, tokenising, the server's own layers; ms)", "info"),
    ("ttft_between_ms", "... on the way to the engine core and back (ms)", "info"),
    ("ttft_queue_ms", "... waiting in the engine core for a step (ms)", "info"),
    ("ttft_prefill_ms", "... scheduled to first token (ms)", "info"),
    ("host_matmul_ms", "the host's fixed work during the window: matrix products (CPU ms; more is a slower host)", "info"),
    ("host_python_ms", "... a Python loop (CPU ms)", "info"),
    ("host_memory_ms", "... a sum over 16 MiB (CPU ms)", "info"),
]
TTFT_PARTS = ("ttft_outside_ms", "ttft_between_ms", "ttft_queue_ms", "ttft_prefill_ms")
LABELS = {"vllm_serve": "vllm serve", "daemon": "daemon (defaults)", "daemon_standby_none": "daemon, standby none",
          "daemon_kv_at_adoption": "daemon, standby_kv at_adoption",
          "daemon_without_starter": "daemon, standby: worker made cold", "daemon_without_idle": "daemon, standby: no idle standby",
          "daemon_without_poll": "daemon, standby: no liveness poll",
          "daemon_without_park": "daemon, standby: workers not parked",
          "daemon_standby_frozen": "daemon, standby frozen",
          "daemon_without_freeze": "daemon, standby: workers not stopped",
          "vllm_serve_mp": "vllm serve (mp)", "daemon_mp": "daemon (mp)"}
# Each daemon is compared with `vllm serve` on the same executor: supervision's own cost is the
# difference within each pair (Ray V2 with our executor class on the same Ray head; vLLM's `mp`).
BASELINE = {"daemon": "vllm_serve", "daemon_standby_none": "vllm_serve", "daemon_kv_at_adoption": "vllm_serve",
            "daemon_without_starter": "vllm_serve", "daemon_without_idle": "vllm_serve",
            "daemon_without_poll": "vllm_serve", "daemon_without_park": "vllm_serve", "daemon_standby_frozen": "vllm_serve",
            "daemon_without_freeze": "vllm_serve", "daemon_mp": "vllm_serve_mp"}
# each daemon kind's `[supervisor]` settings besides the defaults
SUPERVISOR = {"daemon": {}, "daemon_standby_none": {"standby": "none"}, "daemon_kv_at_adoption": {"standby_kv": "at_adoption"},
              "daemon_without_starter": {}, "daemon_without_idle": {}, "daemon_without_poll": {},
              "daemon_without_park": {}, "daemon_standby_frozen": {}, "daemon_without_freeze": {},
              "daemon_mp": {"standby": "none"}}
# the warm standby's parts a daemon kind leaves out, to measure them apart (``supervisor.testhooks``:
# the test hooks' switch on, the only other effect of which on serving is a per-step check in the
# worker for a poisoned request): the workers made cold by vLLM's executor; no standby prepared
# after the build (no fork server, idle worker or liveness poll); the ready standby not polled; its
# workers not parked (awake in Ray's task loop, as before 2026-12-03); its workers not stopped
# (resting under SCHED_IDLE only, as before 2026-12-05)
WITHOUT = {"daemon_without_starter": "starter", "daemon_without_idle": "idle", "daemon_without_poll": "poll",
           "daemon_without_park": "park", "daemon_without_freeze": "freeze"}
# With ``--alone``: the daemon kinds whose ready standby (its worker, the engine core's fork server)
# stays stopped (SIGSTOP) through their own windows too, the defaults otherwise: what of the
# standby's cost is its running (its Ray threads' wake-ups, its parks), not its being there (its
# memory, its actor in Ray's tables)
FROZEN = {"daemon_standby_frozen"}
# `vllm serve` without --distributed-executor-backend is `mp` here: vLLM's CPU platform turns its
# TP=1 default (`uni`, the model in the engine-core process) into `mp`, since OpenMP's binding is
# set up for a worker process (vllm/platforms/cpu.py). On a GPU host it stays `uni`.


def start(kind: str, work: Path, head: RayHead, extra: tuple[str, ...] = ()):
    """``kind``'s server, ready (stopped again if it never is), with ``extra`` vLLM flags."""
    if kind in ("vllm_serve", "vllm_serve_mp"):
        server = VllmServe(work, head if kind == "vllm_serve" else None, extra=extra).start()
    else:
        env = {ENV: "1", STANDBY_WITHOUT_ENV: WITHOUT[kind]} if kind in WITHOUT else {}
        server = start_daemon(work, head, executor="mp" if kind == "daemon_mp" else "ray", extra=extra, env=env,
                              **SUPERVISOR[kind])
    try:
        server.wait_ready()
        if kind in SUPERVISOR and SUPERVISOR[kind].get("standby") != "none" and WITHOUT.get(kind) != "idle":
            server.wait_standby()  # its standby built before the run, as in a server that has been up a while
    except BaseException:
        server.stop()
        raise
    return server


def warm_up(server, work: Path, name: str, args) -> None:
    """One short run, so every server is measured from a warm engine."""
    bench_serve(server.base_url, work, f"warmup-{name}", 8, float("inf"), args.input_len, args.output_len, seed=99,
                client_nice=args.client_nice)


# vLLM's own histograms (sum and count) that ``vllm serve`` and the daemon both export, read before
# and after a round: the engine steps, and where a request's time to first token goes.
HISTOGRAMS = {"steps": "vllm:iteration_tokens_total", "ttft": "vllm:time_to_first_token_seconds",
              "queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds"}


def vllm_histograms(base_url: str) -> dict[str, tuple[float, float]]:
    """(count, sum) of each of ``HISTOGRAMS`` in the server's ``/metrics``."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    names = {v: k for k, v in HISTOGRAMS.items()}
    found = {k: [0.0, 0.0] for k in HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        key = names.get(family.name)
        for sample in family.samples if key else ():
            if sample.name.endswith("_count"):
                found[key][0] += sample.value
            elif sample.name.endswith("_sum"):
                found[key][1] += sample.value
    return {k: (c, s) for k, (c, s) in found.items()}


def ttft_parts(client_mean_ttft_ms: float, before: dict, after: dict) -> dict[str, float | None]:
    """Where the mean time to first token went, from vLLM's histograms over the round:

    - ``ttft_outside_ms``: the client's TTFT less vLLM's (from the request's arrival in vLLM's
      input processor to its first output in the output processor): HTTP, parsing, tokenising,
      and what the server does around vLLM's ``generate`` (the daemon's admission, routing, streams);
    - ``ttft_queue_ms``, ``ttft_prefill_ms``: the engine core's own timestamps, waiting for a
      step, and from being scheduled to the first token;
    - ``ttft_between_ms``: the rest of vLLM's TTFT: the way to the engine core and back (ZMQ,
      the engine core's input and output threads, the front's output handler)."""
    def mean_ms(key):
        count = after[key][0] - before[key][0]
        return 1000 * (after[key][1] - before[key][1]) / count if count > 0 else None
    ttft, queue, prefill = mean_ms("ttft"), mean_ms("queue"), mean_ms("prefill")
    if None in (ttft, queue, prefill):
        return dict.fromkeys(TTFT_PARTS)
    return {"ttft_outside_ms": client_mean_ttft_ms - ttft, "ttft_queue_ms": queue, "ttft_prefill_ms": prefill,
            "ttft_between_ms": ttft - queue - prefill}


PARTS = ("front", "engine_core", "workers", "rest")
# Issue 42's goals for each daemon against `vllm serve` on the same executor (median ratio of the rounds)
GOALS = {"output_throughput": (">=", 0.98), "cpu_ms_per_token": ("<=", 1.02), "p50_ttft_ms": ("<=", 1.05),
         "p50_itl_ms": ("<=", 1.05)}


def median_interval(values: list[float], level: float = 0.9, reps: int = 4000) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values`` (the rounds resampled with replacement,
    a fixed seed): how far this run's median could move on the same machine's noise."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return medians[int((1 - level) / 2 * reps)], medians[int((1 + level) / 2 * reps) - 1]


def against_goal(values: list[float], op: str, goal: float) -> dict:
    """The median ratio, its interval, and whether it meets ``goal`` and this run tells: a goal
    the whole interval meets (or misses) is resolved; otherwise the run's noise spans it."""
    if not values:
        return {"median": None, "interval_90": None, "goal": f"{op} {goal}", "verdict": "n/a"}
    median, (lo, hi) = statistics.median(values), median_interval(values)
    ok = (lambda x: x >= goal) if op == ">=" else (lambda x: x <= goal)
    verdict = ("met" if ok(median) else "missed") + ("" if ok(lo) == ok(hi) else " (within the run's noise)")
    return {"median": median, "interval_90": (lo, hi), "goal": f"{op} {goal}", "verdict": verdict}


def part_of(pid: int, root: int) -> str:
    """Which part of a server ``pid`` is: its front (the server's own process: the API server or
    the daemon), its engine core, its workers (the model), or the rest (Ray's processes, the
    daemon's helpers, an idle standby)."""
    from executor import procfs

    if pid == root:
        return "front"
    title = (procfs.read(pid, "cmdline") or b"").split(b"\0")[0]
    if title.startswith(b"VLLM::EngineCore"):
        return "engine_core"
    if title.startswith((b"VLLM::Worker", b"ray::RayWorkerWrapper", b"ray::SupervisedRayWorkerProc",
                         b"ray::StandbyRayWorkerProc.run", b"ray::RayWorkerProc")):
        return "workers"
    return "rest"


def process_name(pid: int) -> str:
    """A short name for one of the rest's processes: a Ray process's title (``raylet``,
    ``ray::IDLE``), a Python module run with ``-m`` (``executor.reaper``), else the program."""
    from executor import procfs

    argv = [a.decode(errors="replace") for a in (procfs.read(pid, "cmdline") or b"").split(b"\0") if a]
    if not argv:
        return "?"
    if " " in argv[0] and not argv[0].startswith("/"):  # a title (``vllm-supervisor: ray agent``)
        return argv[0][:48]
    program = argv[0].split(" ")[0].rsplit("/", 1)[-1]
    if program.startswith("python"):
        args = iter(argv[1:])
        for arg in args:
            if arg == "-m":
                return next(args, program)
            if arg == "-c":
                return f"{program} -c"
            if arg in ("-X", "-W", "--check-hash-based-pycs"):  # an option with a value
                next(args, None)
                continue
            if not arg.startswith("-"):
                return arg.rsplit("/", 1)[-1]
    return program


def generation(server) -> int | None:
    """The daemon's serving engine generation (None for ``vllm serve``): a fresh server's
    counters pass the warm-up's soon after a rebuild, so a round is judged by this too."""
    return server.status().get("generation") if hasattr(server, "status") else None


def measure(server, work: Path, name: str, head: RayHead, args) -> dict:
    """``vllm bench serve`` against ``server``, and the CPU its tree (and the Ray head's) spent."""
    pids = tree(server.proc.pid, head.marker)
    histograms_before = vllm_histograms(server.base_url)  # a scrape renders every metric: not in the window
    generation_before = generation(server)
    before = tree_cpu_s(pids)
    loop_before = thread_schedstat(server.proc.pid)  # the front's event loop (vLLM's API server, the daemon)
    steal, speed = HostSteal(), HostSpeed()
    try:
        result = bench_serve(server.base_url, work, name, args.num_prompts, args.rate, args.input_len,
                             args.output_len, seed=0, max_concurrency=args.max_concurrency, client_nice=args.client_nice)
    finally:
        host = speed.stop()
    result.update(host, host_steal_pct=steal.pct())
    after = tree_cpu_s(tree(server.proc.pid, head.marker))
    loop_run, loop_wait, loop_runs = (b - a for a, b in zip(loop_before, thread_schedstat(server.proc.pid)))
    histograms_after = vllm_histograms(server.base_url)
    (steps_before, tokens_before), (steps_after, tokens_after) = histograms_before["steps"], histograms_after["steps"]
    cpu = sum(after[p] - before.get(p, 0.0) for p in after)
    tokens = max(1, result["total_output_tokens"])
    by_part: dict[str, float] = {}
    rest: dict[str, float] = {}  # the rest, by process name: what it is made of
    for p in after:
        part = part_of(p, server.proc.pid)
        by_part[part] = by_part.get(part, 0.0) + after[p] - before.get(p, 0.0)
        if part == "rest":
            title = process_name(p)
            rest[title] = rest.get(title, 0.0) + after[p] - before.get(p, 0.0)
    for part in PARTS:
        result[f"cpu_ms_per_token_{part}"] = 1000 * by_part.get(part, 0.0) / tokens
    result["loop_cpu_us_per_token"] = 1e6 * loop_run / tokens
    result["loop_wait_us_per_token"] = 1e6 * loop_wait / tokens
    result["loop_wait_us_per_run"] = 1e6 * loop_wait / max(1, loop_runs)
    result["cpu_ms_per_token_rest_by_process"] = {
        title: round(1000 * s / tokens, 4) for title, s in sorted(rest.items(), key=lambda kv: -kv[1])}
    # At the same throughput, a server whose front admits requests sooner runs larger engine
    # steps, each longer: ITL per chunk then rises with the batch, not with a per-token cost.
    # vLLM's counters start again with a new engine: a round in which the daemon rebuilt its
    # engine (a hang verdict, a crash) measured a recovery, which the table marks, and has no
    # step figures
    result["engine_restarted"] = steps_after < steps_before or generation(server) != generation_before
    steps = max(1.0, steps_after - steps_before)
    result["tokens_per_step"] = None if result["engine_restarted"] else (tokens_after - tokens_before) / steps
    result["step_ms"] = None if result["engine_restarted"] else 1000 * result["duration"] / steps
    result.update(dict.fromkeys(TTFT_PARTS) if result["engine_restarted"] else
                  ttft_parts(result["mean_ttft_ms"], histograms_before, histograms_after))
    result["cpu_s"] = cpu
    result["cpu_ms_per_token"] = 1000 * cpu / max(1, result["total_output_tokens"])
    # vLLM's collector merges the tokens a reader has not yet taken into one chunk: how many
    # chunks a client read tells how often the server fell behind (the ITLs of a request sum to
    # its e2e latency less its TTFT, so this is exact)
    result["chunks_per_request"] = ((result["mean_e2el_ms"] - result["mean_ttft_ms"]) / result["mean_itl_ms"]
                                    if result["mean_itl_ms"] else 0.0)  # one token each: no ITL
    assert result["failed"] == 0, result
    return result


def engine_flags(args) -> tuple[str, ...]:
    return ("--max-num-seqs", str(args.max_num_seqs)) if args.max_num_seqs else ()


@contextlib.contextmanager
def warm_server(kind: str, work: Path, head: RayHead, name: str, args, extra: tuple[str, ...] = ()) -> Iterator[Any]:
    """``kind``'s server (``start``), warmed up (``warm_up``) and left idle ``args.settle_s``
    seconds for the block, stopped after it."""
    server = start(kind, work, head, extra)
    try:
        warm_up(server, work, name, args)
        time.sleep(args.settle_s)
        yield server
    finally:
        server.stop()


def run_one(kind: str, work: Path, head: RayHead, r: int, args) -> dict:
    with warm_server(kind, work, head, f"{kind}-{r}", args, engine_flags(args)) as server:
        return measure(server, work, f"{kind}-{r}", head, args)


def alternating(kinds: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, kind) for ``rounds`` rounds of every kind: how every bench and probe here
    alternates its servers, in a Williams design. Its first order is 0, 1, n-1, 2, n-2, ...,
    each next one adds 1 to every place (mod n), and with an odd number of kinds each order is
    followed by its reverse; the numbers are named so that the first round is ``kinds``. Two
    kinds run A B, B A, ...; three A B C, C B A, B C A, A C B, C A B, B A C. Over every n rounds
    (2n with an odd n), each kind takes each place, and follows each other kind within a round,
    equally often. Only reversing would leave a middle kind in the middle of every round,
    always after the same neighbour."""
    n = len(kinds)
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(i + shift) % n for i in first] for shift in range(n)]
    if n % 2:
        orders = [o for order in orders for o in (order, order[::-1])]
    label = {v: kinds[place] for place, v in enumerate(first)}  # so the first round is ``kinds`` as given
    for r in range(rounds):
        for v in orders[r % len(orders)]:
            yield r, label[v]


def warm_rounds(kinds: list[str], rounds: int, prefix: str, args,
                starts_as: dict[str, str] | None = None) -> Iterator[tuple[int, str, Any, Path, RayHead]]:
    """(round, kind, its warm server, the round's directory, the Ray head) for each of
    ``alternating``'s rounds, each server started and warmed (``warm_server``) on one Ray head of 2
    CPUs in a directory of its own under a new one named ``prefix``…, and stopped once the
    caller's body for that round is done: the probes' rounds (``bench/results/``). A probe's own
    kind starts as the server ``starts_as`` names (``{"daemon_niced_standby": "daemon"}``), which
    the probe's body then changes from outside. The temporary directory goes with the Ray head: a
    probe copies what it keeps out of a round's directory within that round."""
    starts_as = starts_as or {}
    work = Path(tempfile.mkdtemp(prefix=prefix))
    head = RayHead(num_cpus=2).start()
    try:
        for r, kind in alternating(kinds, rounds):
            (work / f"{kind}-{r}").mkdir()
            with warm_server(starts_as.get(kind, kind), work / f"{kind}-{r}", head, f"{kind}-{r}", args) as server:
                yield r, kind, server, work / f"{kind}-{r}", head
    finally:
        head.stop()
        shutil.rmtree(work, ignore_errors=True)


class ProbeLoad:
    """The load the probes under ``bench/results/`` warm each server with and run at saturation:
    32 in / 64 out tokens, the benchmark client at niceness -10 (``warm_rounds``' ``args``)."""
    input_len, output_len, client_nice, settle_s = 32, 64, -10, 0.0


class SaturationLoad(ProbeLoad):
    """``--saturation``'s load as ``measure``'s ``args``, for the probes that measure a server as
    this bench does: 400 prompts, 8 streams always in flight, no rate limit."""
    num_prompts, rate, max_concurrency = 400, float("inf"), 8


def print_ratios(runs: dict[str, list[dict]], keys: tuple[str, ...], baseline: str = "vllm_serve") -> None:
    """A probe's summary: each kind's median ratio to ``baseline`` (min-max over the rounds) for ``keys``."""
    print(f"\nmedian ratio to {baseline} (min-max over the rounds):")
    for kind in (k for k in runs if k != baseline):
        cells = []
        for key in keys:
            ratios = [a[key] / b[key] for a, b in zip(runs[kind], runs[baseline]) if a[key] and b[key]]
            cells.append(f"{key} {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"  {kind}: " + ", ".join(cells))


@contextlib.contextmanager
def stopped(pids: list[int]) -> Iterator[list[int]]:
    """``pids`` stopped (SIGSTOP) for the block and continued (SIGCONT) after it, however the block
    ends: the probes' standby frozen over a load."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def server_stopped(server) -> tuple[int, ...]:
    """The processes a daemon stopped itself (its ready standby's workers: ``standby.stopped``)."""
    return tuple(server.status().get("standby", {}).get("stopped", []))


def standby_pids(server) -> list[int]:
    """The processes of a daemon's warm standby (the engine core's fork server, its workers), from
    its status; the probes stop or renice them from outside."""
    standby = server.status()["standby"]
    return [p for p in [standby.get("forkserver_pid"), *(w.get("pid") for w in standby["workers"])] if p]


def loop_load(server: Any, work: Path, name: str) -> str:
    """The probes' saturation load (2000 prompts, 8 at a time, 32 in / 64 out, the client at -10)
    against ``server``, and its front's event-loop thread per output token over it (``/proc``
    schedstat): "N req/s, loop X µs/token on a core, Y waiting, Z runs/token"."""
    pid = server.proc.pid
    before = thread_schedstat(pid)
    result = bench_serve(server.base_url, work, name, 2000, float("inf"), 32, 64, max_concurrency=8, client_nice=-10)
    run, wait, runs = (b - a for a, b in zip(before, thread_schedstat(pid)))
    tokens = result["total_output_tokens"]
    return (f"{result['request_throughput']:.1f} req/s, loop {1e6 * run / tokens:.1f} µs/token on a core, "
            f"{1e6 * wait / tokens:.1f} waiting, {runs / tokens:.2f} runs/token")


def generated_tokens(base_url: str) -> float:
    """The server's ``vllm:generation_tokens_total``, summed over its label sets."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(text) if family.name == "vllm:generation_tokens"
               for sample in family.samples if sample.name.endswith("_total"))


def tokens_while(server: Any, work: Path, name: str, action: Callable[[], Any], after_s: float = 8.0,
                 prompts: int = 2000) -> float:
    """The output tokens ``server`` generated while ``action()`` ran, ``after_s`` into a
    saturation load (``prompts``, 8 at a time, ``ProbeLoad``'s lengths): a probe's window in the
    middle of a load (``strace``, ``perf``)."""
    window: dict[str, float] = {}

    def act() -> None:
        time.sleep(after_s)
        window["before"] = generated_tokens(server.base_url)
        action()
        window["after"] = generated_tokens(server.base_url)

    actor = threading.Thread(target=act)
    actor.start()
    bench_serve(server.base_url, work, name, prompts, float("inf"), ProbeLoad.input_len, ProbeLoad.output_len,
                max_concurrency=8, client_nice=ProbeLoad.client_nice)
    actor.join()
    return window["after"] - window["before"]


def run_rounds(kinds: list[str], work: Path, head: RayHead, args) -> dict[str, list[dict]]:
    """Each round starts each server, measures it and stops it, in ``alternating``'s order (A B,
    B A, ...): a server measured always first or always second on the same head (which
    keeps what earlier rounds left, and a machine whose speed drifts) would carry that as a bias."""
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for r, kind in alternating(kinds, args.rounds):
        (work / f"{kind}-{r}").mkdir()
        runs[kind].append(report(r, kind, run_one(kind, work / f"{kind}-{r}", head, r, args)))
    return runs


def ray_workers(head: RayHead) -> dict[int, int]:
    """The Ray head's worker processes that run something (``ray::…``, not ``ray::IDLE``): pid →
    start time, so that a pid reused by another process is not taken for one of them."""
    from executor import procfs

    out = {}
    for pid in tree([], head.marker):
        title = (procfs.read(pid, "cmdline") or b"").split(b"\0")[0]
        if title.startswith(b"ray::") and title != b"ray::IDLE" and (started := procfs.start_time(pid)) is not None:
            out[pid] = started
    return out


def server_pids(server, workers: dict[int, int]) -> list[int]:
    """``server``'s processes now: its own tree and those of its Ray workers still alive
    (``workers``, pid → start time: the Ray head's that appeared while it started or ran)."""
    from executor import procfs

    return sorted(set(tree(server.proc.pid)) | {p for p, t in workers.items() if procfs.start_time(p) == t})


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def alone(kind: str, servers: dict[str, Any], workers: dict[str, dict[int, int]], head: RayHead,
          thaw_s: float, frozen: tuple[int, ...] = ()) -> Iterator[None]:
    """``kind``'s server continued (SIGCONT) ``thaw_s`` before the block, so that what its timers
    owe is done before the window, and stopped again (SIGSTOP) after it, with the Ray workers that
    appeared meanwhile (a standby's replacement, a rebuild's: every other server is stopped, so
    they are its own); the others stay stopped, and so do ``frozen`` (``FROZEN``' standby)."""
    signal_all([p for p in server_pids(servers[kind], workers[kind]) if p not in frozen], signal.SIGCONT)
    try:
        time.sleep(thaw_s)
        yield
    finally:
        workers[kind].update({p: t for p, t in ray_workers(head).items()
                              if not any(w.get(p) == t for w in workers.values())})
        signal_all(server_pids(servers[kind], workers[kind]), signal.SIGSTOP)


def run_interleaved(kinds: list[str], work: Path, head: RayHead, args) -> dict[str, list[dict]]:
    """Every server up at once; each round measures each, in ``alternating``'s order.
    ``args.alone``: every server but the one measured is stopped (SIGSTOP, its Ray workers with
    it) over each window, as if it were alone on the host."""
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    servers: dict[str, Any] = {}
    workers: dict[str, dict[int, int]] = {}
    try:
        for kind in kinds:
            (work / kind).mkdir()
            before = ray_workers(head)
            servers[kind] = start(kind, work / kind, head, engine_flags(args))
            # started one after the other: the Ray workers that appeared are each server's own
            workers[kind] = {p: t for p, t in ray_workers(head).items() if before.get(p) != t}
        for kind in kinds:
            warm_up(servers[kind], work / kind, kind, args)
        time.sleep(args.settle_s)
        frozen = {kind: tuple(standby_pids(servers[kind])) for kind in kinds if kind in FROZEN}
        for kind, pids in frozen.items():
            print(f"{kind}: its standby's processes {list(pids)} stay stopped through its windows", flush=True)
            signal_all(list(pids), signal.SIGSTOP)
        for kind in kinds:  # what a daemon stopped itself (its ready standby's workers) it alone continues
            if kind in BASELINE and kind not in frozen and (own := server_stopped(servers[kind])):
                frozen[kind] = own
                print(f"{kind}: its standby's workers {list(own)}, stopped by the daemon, are left to it", flush=True)
        if args.alone:
            for kind in kinds:
                signal_all(server_pids(servers[kind], workers[kind]), signal.SIGSTOP)
        for r, kind in alternating(kinds, args.rounds):
            with alone(kind, servers, workers, head, args.thaw_s, frozen.get(kind, ())) if args.alone else contextlib.nullcontext():
                runs[kind].append(report(r, kind, measure(servers[kind], work / kind, f"{kind}-{r}", head, args)))
                if kind in FROZEN and tuple(standby_pids(servers[kind])) != frozen[kind]:
                    raise RuntimeError(f"{kind}'s standby changed while it was stopped: {standby_pids(servers[kind])}")
                if kind in BASELINE and kind not in FROZEN:  # a standby replaced meanwhile is stopped anew
                    frozen[kind] = server_stopped(servers[kind])
    finally:
        for kind, server in servers.items():  # every one continued before any is stopped
            signal_all(server_pids(server, workers.get(kind, {})), signal.SIGCONT)
        for kind, server in servers.items():
            try:
                server.stop()
            except Exception:
                traceback.print_exc()
                print(f"could not stop {kind}; stopping the others", flush=True)
    return runs


def report(r: int, kind: str, result: dict) -> dict:
    print(f"round {r + 1} {kind}: {result['request_throughput']:.2f} req/s, {result['output_throughput']:.0f} tok/s, "
          f"TTFT p50 {result['p50_ttft_ms']:.1f} ms, ITL p50 {result['p50_itl_ms']:.2f} ms, "
          f"{result['cpu_ms_per_token']:.2f} CPU-ms/token, {result['chunks_per_request']:.1f} chunks/request, "
          f"host steal {result.get('host_steal_pct', 0):.2f} %, host work {host_work(result)} ms, "
          + ("its engine was rebuilt in this round" if result["engine_restarted"] else
             f"{result['tokens_per_step']:.2f} tokens/step, {result['step_ms']:.2f} ms/step"), flush=True)
    rest = result.get("cpu_ms_per_token_rest_by_process", {})
    print("  CPU-ms/token by part: " + ", ".join(f"{p} {result[f'cpu_ms_per_token_{p}']:.3f}" for p in PARTS)
          + "; the rest: " + ", ".join(f"{name} {ms:.4f}" for name, ms in list(rest.items())[:6]), flush=True)
    print(f"  the front's event loop per token: {result['loop_cpu_us_per_token']:.1f} µs on a core, "
          f"{result['loop_wait_us_per_token']:.1f} µs waiting for one ({result['loop_wait_us_per_run']:.1f} µs per run)", flush=True)
    if result.get("ttft_queue_ms") is not None:
        print(f"  mean TTFT {result['mean_ttft_ms']:.1f} ms: " + ", ".join(
            f"{part[5:-3]} {result[part]:.1f}" for part in TTFT_PARTS), flush=True)
    return result


def _interrupted(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    # SIGTERM ends a run as Ctrl-C does (every server continued and stopped, the Ray head with
    # them): a run started in the background of a script ignores SIGINT
    signal.signal(signal.SIGTERM, _interrupted)
    parser = base_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saturation", action="store_true", help="no rate limit, --max-concurrency streams")
    parser.add_argument("--interleave", action="store_true",
                        help="start the servers once, side by side, and alternate them within each round")
    parser.add_argument("--alone", action="store_true",
                        help="with --interleave: every server but the one measured stopped (SIGSTOP) over each "
                             "window, so that each window runs as if its server were alone on the host, seconds "
                             "from the others' windows")
    parser.add_argument("--thaw-s", type=float, default=5.0,
                        help="with --alone: seconds a server runs after it is continued before its window")
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--rate", type=float)
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument("--max-num-seqs", type=int,
                        help="vLLM's --max-num-seqs for every server: below --max-concurrency, every engine "
                             "step holds that many streams in each server, so ITL is compared at equal batch")
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--client-nice", type=int, default=0,
                        help="run the benchmark client in a session of its own at this niceness (e.g. -10; root): "
                             "on few cores the servers' spinning engine core and worker otherwise starve it, which "
                             "a client on another host never is (0: the client in this process's session, as before)")
    parser.add_argument("--settle-s", type=float, default=0.0,
                        help="seconds each server is left idle after its warm-up (and, for a daemon, after its "
                             "standby is ready) before it is measured: tells a transient of the standby's making "
                             "(memory, caches) from a steady cost; every kind waits the same")
    parser.add_argument("--kinds", nargs="+", choices=list(LABELS), help="servers, in this order in the first round (vllm_serve first); the order follows a Williams design (A B, B A; with three or more, each kind in each place)")
    args = parser.parse_args()
    if args.alone and not args.interleave:
        parser.error("--alone stops the servers that are not measured: it needs --interleave")
    defaults = ({"num_prompts": 400, "rate": float("inf"), "max_concurrency": 8, "input_len": 32, "output_len": 64}
                if args.saturation else {"num_prompts": 64, "rate": 16.0, "max_concurrency": None, "input_len": 64, "output_len": 64})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    kinds = args.kinds or (["vllm_serve", "daemon", "daemon_standby_none", "vllm_serve_mp", "daemon_mp"]
                           if args.saturation else ["vllm_serve", "daemon"])
    missing = {BASELINE[k] for k in kinds if k in BASELINE} - set(kinds)
    assert not missing, f"each daemon is compared with its baseline: add {sorted(missing)}"
    if FROZEN & set(kinds) and not args.interleave:
        parser.error(f"{sorted(FROZEN & set(kinds))} need --interleave: a standby is stopped once it is ready")
    daemons = [k for k in kinds if k in BASELINE]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    # side by side, each Ray V2 server's placement group needs its own CPU bundle: the head
    # declares one logical CPU per server (the machine's cores are what they are)
    ray_servers = sum(1 for k in kinds if not k.endswith("_mp"))
    head = RayHead(num_cpus=max(2, ray_servers) if args.interleave else 2).start()
    try:
        runs = (run_interleaved if args.interleave else run_rounds)(kinds, work, head, args)
    except BaseException:
        traceback.print_exc()
        print(f"the servers' logs are kept in {work}", flush=True)
        raise
    finally:
        inject.disconnect()
        head.stop()
    shutil.rmtree(work, ignore_errors=True)  # the servers' logs and configs: each round's figures are in `runs`
    rows = []
    for key, label, better in METRICS:
        row = {"metric": label, "key": key, "better": better, **{k: [x[key] for x in runs[k]] for k in kinds}}
        for k in daemons:  # a round without the figure (None: an engine restarted) is left out
            row[f"ratios_{k}"] = [d[key] / v[key] for d, v in zip(runs[k], runs[BASELINE[k]])
                                  if v[key] and d[key] is not None]
        rows.append(row)
    mode = (f"saturation: {args.max_concurrency} streams always in flight, no rate limit" if args.saturation
            else f"{args.rate:g} req/s") + (f", --max-num-seqs {args.max_num_seqs}" if args.max_num_seqs else "")
    table = [
        f"Serving overhead, {time.strftime('%Y-%m-%d')}: {args.rounds} "
        f"{'interleaved rounds (the servers up side by side' if args.interleave else 'rounds (each server alone'}, "
        f"{'the order reversed every other round' if len(kinds) < 3 else 'the order in a Williams design, each server in each place'}), "
        + (f"every server but the one measured stopped (SIGSTOP) over each window and continued {args.thaw_s:g} s before its own, "
           if args.alone else "")
        + f"{args.num_prompts} prompts, "
        f"{mode}, {args.input_len} in / {args.output_len} out tokens, TP=1, demo model on CPU, Ray V2 servers on one Ray head, mp servers without Ray"
        + (f", the client in a session of its own at niceness {args.client_nice}" if args.client_nice else "")
        + (f", each server left idle {args.settle_s:g} s after its warm-up" if args.settle_s else ""),
        "",
        "| metric | " + " | ".join(f"ratio {LABELS[k]} / {LABELS[BASELINE[k]]} (min / median / max)" for k in daemons) + " | "
        + " | ".join(f"{LABELS[k]} (median)" for k in kinds) + " |",
        "| --- | " + " | ".join("---" for _ in daemons) + " | " + " | ".join("---" for _ in kinds) + " |",
    ]
    for row in rows:
        table.append(f"| {row['metric']}{'' if row['better'] == 'info' else ' (' + row['better'] + ' is better)'} | "
                     + " | ".join(spread(row[f"ratios_{k}"]) for k in daemons) + " | "
                     + " | ".join(f"{statistics.median([x for x in row[k] if x is not None] or [float('nan')]):.2f}"
                                  for k in kinds) + " |")
    by_key = {row["key"]: row for row in rows}
    goals = {k: {key: against_goal(by_key[key][f"ratios_{k}"], op, goal) for key, (op, goal) in GOALS.items()}
             for k in daemons}
    table += [
        "", "Issue 42's goals, median ratio of the rounds with a 90 % bootstrap interval of that median (the rounds "
        "resampled): a goal is resolved when the whole interval is on one side of it.", "",
        "| metric | goal | " + " | ".join(f"{LABELS[k]} / {LABELS[BASELINE[k]]}" for k in daemons) + " |",
        "| --- | --- | " + " | ".join("---" for _ in daemons) + " |",
        *[f"| {by_key[key]['metric']} | {op} {goal} | " + " | ".join(
            (f"{g['median']:.3f} ({g['interval_90'][0]:.3f}–{g['interval_90'][1]:.3f}): {g['verdict']}"
             if g["median"] is not None else "n/a") for g in (goals[k][key] for k in daemons)) + " |"
          for key, (op, goal) in GOALS.items()],
    ]
    table += [
        "", "Each round (request/s, output tok/s, TTFT p50 ms, ITL p50 ms, CPU-ms per token, the host's steal %, "
        "the host's fixed work in CPU ms: matrix products + Python loop + memory sum):", "",
        "| round | " + " | ".join(LABELS[k] for k in kinds) + " |", "| --- | " + " | ".join("---" for _ in kinds) + " |",
        *[f"| {i + 1} | " + " | ".join(
            f"{x['request_throughput']:.2f}, {x['output_throughput']:.0f}, {x['p50_ttft_ms']:.1f}, {x['p50_itl_ms']:.2f}, "
            f"{x['cpu_ms_per_token']:.2f}, {x.get('host_steal_pct', 0):.2f}, "
            f"{host_work(x)}{' (its engine was rebuilt in this round)' if x.get('engine_restarted') else ''}"
            for x in (runs[k][i] for k in kinds)) + " |" for i in range(args.rounds)],
    ]
    rest = {k: [x.get("cpu_ms_per_token_rest_by_process", {}) for x in runs[k]] for k in kinds}
    names = sorted({n for k in kinds for r in rest[k] for n in r},
                   key=lambda n: -max(statistics.median([r.get(n, 0.0) for r in rest[k]] or [0.0]) for k in kinds))
    table += [
        "", "The rest by process (CPU-ms per output token, median of the rounds):", "",
        "| process | " + " | ".join(LABELS[k] for k in kinds) + " |", "| --- | " + " | ".join("---" for _ in kinds) + " |",
        *[f"| {n} | " + " | ".join(f"{statistics.median([r.get(n, 0.0) for r in rest[k]] or [0.0]):.4f}" for k in kinds)
          + " |" for n in names[:12]],
    ]
    text = "\n".join(table) + "\n"
    name = (("serving_saturation" if args.saturation else "serving_overhead") + ("_interleaved" if args.interleave else "")
            + ("_alone" if args.alone else ""))
    (args.out / f"{name}.md").write_text(text)
    (args.out / f"{name}.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows,
                                                         "goals": goals, "rest_by_process": rest}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
