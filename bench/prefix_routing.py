"""Prefix-aware routing vs least streams on 2 replicas, and vs ``vllm serve --data-parallel-size 2``,
under a multi-turn chat load.

``--conversations`` chats (32) of ``--turns`` turns (6) each, over ``--system-prompts`` shared
system prompts (4), ``--concurrency`` conversations at a time (8); each turn sends the whole
history (system prompt, earlier turns and the model's own replies) through the openai SDK,
streamed, greedy, ``--max-tokens`` tokens. The daemon runs ``--data-parallel-size 2`` (two
replicas) on its own local Ray (``--ray local``, the default, as ``make run`` starts it; ``--ray head``:
one Ray head started by the bench) with ``--enable-prompt-tokens-details``, once per routing policy; the
alternative a user has without the daemon (issue 42), ``vllm serve --data-parallel-size 2`` (two
engines behind vLLM's own front end, which balances them by queue length: vLLM's default mp
backend, no Ray), runs the same load with the same flags, with vLLM's default OpenMP binding and
with one core per engine; ``prefix_mp`` is the daemon's ``prefix`` on vLLM's ``mp`` executor
(``--distributed-executor-backend mp``) instead of Ray V2, ``prefix_no_standby`` its ``prefix`` on Ray V2
with ``standby = "none"``, ``prefix_core_each`` its ``prefix`` with the one-core-each list
(``VLLM_CPU_OMP_THREADS_BIND=0|1``, one entry per replica), ``prefix_mp_core_each`` the same on ``mp``,
``least_streams_core_each`` least streams with it. The nine (or ``--kinds``) alternate for ``--rounds`` rounds, the order
reversed every other round (A B, B A, ...), so that what one server leaves behind, or a machine whose
speed drifts, is not carried by one kind alone. Per kind: the prefix-cache
hit rate (prompt tokens the engines found cached, from each response's
``usage.prompt_tokens_details``: vLLM's own count per request, over all requests), the time to
first token p50 / p99 and the throughput (requests / took).

    python -m bench.prefix_routing --out bench/results
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import openai

from bench.common import MODEL_NAME, HostSpeed, HostSteal, VllmServe, base_parser, host_work, prioritise
from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, RayHead

DP2, DP2_CORE_EACH = "vllm_serve_dp2", "vllm_serve_dp2_core_each"
PREFIX_MP = "prefix_mp"  # the daemon's replicas on vLLM's own mp executor instead of Ray V2
PREFIX_CORE_EACH = "prefix_core_each"  # the daemon's prefix with DP2_CORE_EACH's list of cores per replica
PREFIX_MP_CORE_EACH = "prefix_mp_core_each"  # the same on the mp executor
LEAST_CORE_EACH = "least_streams_core_each"  # least streams with the same list
CORE_EACH_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PREFIX_NO_STANDBY = "prefix_no_standby"  # Ray V2 without the warm standby (``standby = "none"``)
KINDS = ("least_streams", "prefix", DP2, DP2_CORE_EACH, PREFIX_MP, PREFIX_NO_STANDBY, PREFIX_CORE_EACH, PREFIX_MP_CORE_EACH,
         LEAST_CORE_EACH)
CORE_EACH = (PREFIX_CORE_EACH, PREFIX_MP_CORE_EACH, LEAST_CORE_EACH)
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud ember").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def conversation(client: openai.AsyncOpenAI, system: str, seed: int, args) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}]
    out = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": text(rng, args.user_words)})
        started = time.monotonic()
        first = None
        reply = []
        usage = None
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.monotonic() - started
                reply.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        details = getattr(usage, "prompt_tokens_details", None)
        out.append({"ttft_s": first, "prompt_tokens": usage.prompt_tokens,
                    "cached_tokens": (details.cached_tokens or 0) if details else None,
                    "conversation": seed, "turn": turn, "started": started, "ended": time.monotonic()})
        messages.append({"role": "assistant", "content": "".join(reply)})
    return out


async def workload(base_url: str, args) -> list[dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    systems = [text(random.Random(1000 + s), args.system_words) for s in range(args.system_prompts)]
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> list[dict[str, Any]]:
        async with gate:
            return await conversation(client, systems[i % len(systems)], i, args)

    results = await asyncio.gather(*(one(i) for i in range(args.conversations)))
    await client.close()
    return [r for conv in results for r in conv]


def measure(base_url: str, args) -> dict[str, Any]:
    """The workload against ``base_url`` and its figures; with ``--client-nice N`` (not 0) the
    client runs in a process and session of its own at that niceness (``bench.common.prioritise``),
    as ``bench.serving_overhead``'s does, so that the servers' spinning engine cores and workers do
    not starve it on a host of few cores."""
    if not getattr(args, "client_nice", 0):
        return _measure(base_url, args)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_client_session,
                             initargs=(args.client_nice,)) as pool:
        return pool.submit(_measure, base_url, args).result(timeout=900)


def _client_session(nice: int) -> None:
    os.setsid()
    prioritise(os.getpid(), nice)


def _measure(base_url: str, args) -> dict[str, Any]:
    started, steal, speed = time.monotonic(), HostSteal(), HostSpeed()
    try:
        requests = asyncio.run(workload(base_url, args))
    finally:
        host = speed.stop()
    took = time.monotonic() - started
    ttft = sorted(r["ttft_s"] for r in requests if r["ttft_s"] is not None)
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] or 0 for r in requests)
    return {"requests": len(requests), "took_s": round(took, 1), "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "details_missing": sum(r["cached_tokens"] is None for r in requests), "host_steal_pct": steal.pct(), **host}


def daemon_setup(policy: str, head: RayHead | None = None, slack: int | None = None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The daemon's config and flags for a routing ``policy`` or a daemon kind (``prefix_mp``,
    ``prefix_no_standby``: the ``prefix`` routing on the ``mp`` executor, or without the standby)."""
    config = {"engine": {"max_model_len": 1024}, "ray": {"address": head.address if head else ""},
              "supervisor": {"routing": ("least_streams" if policy == LEAST_CORE_EACH else
                                         "prefix" if policy in (PREFIX_MP, PREFIX_NO_STANDBY, *CORE_EACH) else policy),
                             **({"standby": "none"} if policy == PREFIX_NO_STANDBY else {}),
                             **({"routing_slack": slack} if slack is not None else {})}}
    flags = ("--data-parallel-size", "2", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
             *(("--distributed-executor-backend", "mp") if policy in (PREFIX_MP, PREFIX_MP_CORE_EACH) else ()))
    return config, flags


def run_policy(work: Path, head: RayHead | None, policy: str, args) -> dict[str, Any]:
    config, flags = daemon_setup(policy, head, args.routing_slack)
    # on its own Ray, the user's environment alone (the operator's token is the bench's head's)
    env = {**(OPERATOR_ENV if head else {}), **(CORE_EACH_ENV if policy in CORE_EACH else {})}
    with Daemon(work, config, env=env or None, args=flags, own_session=True).start() as daemon:
        daemon.wait_ready()
        daemon.wait_replicas_serving()
        # its standby built before the run, as in a server that has been up a while: while it is
        # built (about 40 s after the start here) its worker loads the model on the replicas' core
        if policy != PREFIX_NO_STANDBY:
            daemon.wait_standby()
        row = measure(daemon.base_url, args)
        status = daemon.status()
        code, _ = daemon.stop()
        assert code == 0, daemon.tail()
    return {"policy": policy, **row, "routing": status.get("routing")}


def run_vllm_dp2(work: Path, kind: str, args) -> dict[str, Any]:
    """``vllm serve --data-parallel-size 2`` with the daemon's engine settings and its access log
    off (as ``plain_vllm_serve``): vLLM's DP coordinator and two engine processes, no Ray; with ``--ray head``
    the daemon's idle Ray head stays up meanwhile. By default vLLM's CPU build binds each engine's
    OpenMP threads to the cores left after reserving one per engine on the NUMA node, here core 0
    for both; the daemon binds its replicas' Ray workers the same way (``executor.cpu_binding``).
    ``DP2_CORE_EACH`` gives each engine its
    own core (``VLLM_CPU_OMP_THREADS_BIND=0|1``), the setting a user would tune to."""
    server = VllmServe(work, None, extra=("--data-parallel-size", "2", "--enable-prompt-tokens-details"))
    if kind == DP2_CORE_EACH:
        server.env.update(CORE_EACH_ENV)
    server.start()
    try:
        server.wait_ready()
        return {"policy": kind, **measure(server.base_url, args)}
    finally:
        server.stop()


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rows) for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")} | {
        "req_s": statistics.median(r["requests"] / r["took_s"] for r in rows)}


def workload_parser(doc: str | None = __doc__):
    """The bench's argument parser: the chat workload (``measure`` reads it) and the rounds."""
    parser = base_parser(doc)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=60)
    parser.add_argument("--user-words", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--client-nice", type=int, default=0,
                        help="run the client in a session of its own at this niceness (e.g. -10; root): 0 keeps it "
                             "in this process")
    parser.add_argument("--routing-slack", type=int,
                        help="the daemons' supervisor.routing_slack (the daemon's default: 4)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="servers, in this order in the first round; reversed every other round")
    return parser


def main() -> int:
    parser = workload_parser()
    parser.add_argument("--ray", choices=("local", "head"), default="local",
                        help="local: each daemon starts its own Ray, as `make run` and the systemd unit do, so its "
                             "workers run in the daemon's session, as `vllm serve`'s run in its own; head: one "
                             "Ray head started here, whose workers run in this process's session, beside the client "
                             "(the kernel's autogroups weigh them with the client, not with the daemon)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    head = RayHead(num_cpus=2).start() if args.ray == "head" else None
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="prefix-routing-") as tmp:
            for r in range(args.rounds):
                for kind in (args.kinds if r % 2 == 0 else args.kinds[::-1]):
                    work = Path(tmp) / f"{kind}-{r}"
                    work.mkdir()
                    row = run_vllm_dp2(work, kind, args) if kind.startswith("vllm") else run_policy(work, head, kind, args)
                    row["round"] = r + 1
                    print(row, flush=True)
                    rows.append(row)
    finally:
        inject.disconnect()
        if head is not None:
            head.stop()
    print(write_report(rows, args, own_ray=head is None))
    return 0


def write_report(rows: list[dict[str, Any]], args: Any, own_ray: bool = True) -> str:
    """The rounds' table, the medians and the ratios, into ``args.out`` (``prefix-routing.md``,
    and the rows as ``prefix-routing.json``); returns the table. A run cut short after whole
    rounds is reported from its printed rows the same way."""
    lines = [f"# Prefix-aware routing, least streams and `vllm serve --data-parallel-size 2` ({time.strftime('%Y-%m-%d')}; "
             f"2 replicas of the demo model, TP=1 each: the daemon's on {'its own local Ray' if own_ray else 'one Ray head'}, vllm serve's its own DP=2 engines, "
             "each server's models on core 0 by default (vllm serve's: or one core each); "
             f"2 cores; {args.conversations} conversations × {args.turns} turns over {args.system_prompts} system prompts, "
             f"{args.concurrency} at a time, {args.max_tokens} tokens per reply)", "",
             "| round | routing | requests | prompt tokens found cached (hit rate) | TTFT p50 (ms) | TTFT p99 (ms) | took (s) | host steal (%) "
             "| host work, matmul + python + memory (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['round']} | {row['policy']} | {row['requests']} | {row['cached_tokens']} / {row['prompt_tokens']} "
                     f"({100 * row['hit_rate']:.1f} %) | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} | {row['took_s']} "
                     f"| {row.get('host_steal_pct', 0):.2f} | {host_work(row)} |")
    lines += ["", "Medians over the rounds:", "",
              "| routing | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | throughput (req/s) |", "| --- | --- | --- | --- | --- |"]
    median = {kind: medians([r for r in rows if r["policy"] == kind]) for kind in args.kinds}
    for kind, m in median.items():
        lines.append(f"| {kind} | {100 * m['hit_rate']:.1f} % | {m['ttft_p50_ms']:.1f} | {m['ttft_p99_ms']:.1f} | {m['req_s']:.2f} |")
    for name, ours, kind in [(o, median[o], k) for o in ("prefix", PREFIX_MP, PREFIX_NO_STANDBY, *CORE_EACH) if o in median
                             for k in (DP2, DP2_CORE_EACH, PREFIX_MP, PREFIX_MP_CORE_EACH) if k in median and k != o]:
        theirs = median[kind]
        lines.append(f"\n{name} / {kind} (medians): hit rate {ours['hit_rate'] / theirs['hit_rate']:.2f}x, "
                     f"TTFT p50 {ours['ttft_p50_ms'] / theirs['ttft_p50_ms']:.2f}x, "
                     f"TTFT p99 {ours['ttft_p99_ms'] / theirs['ttft_p99_ms']:.2f}x, "
                     f"throughput {ours['req_s'] / theirs['req_s']:.2f}x")
    text_out = "\n".join(lines) + "\n"
    (args.out / "prefix-routing.md").write_text(text_out)
    (args.out / "prefix-routing.json").write_text(json.dumps(rows, indent=2) + "\n")
    return text_out


if __name__ == "__main__":
    raise SystemExit(main())
