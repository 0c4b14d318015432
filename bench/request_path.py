"""The request path's own cost: CPU per token and per request that the daemon's stream path
(``SupervisedEngineClient.generate`` -> ``Streams`` -> ``Carryover`` -> the engine's stream) adds
over reading the engine's stream directly, as ``vllm serve``'s front reads ``AsyncLLM``.

Both read the same in-process engine (the unit tests' fake: no model, instant steps), so the
difference is the supervisor's code alone, without the model's and the machine's noise that
``bench.serving_overhead`` measures through. Rounds alternate the two paths; the figures are
the medians of the rounds.

    python -m bench.request_path --requests 400 --tokens 128 --concurrency 8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path


async def _read(stream) -> int:
    n = 0
    async for out in stream:
        n += len(out.outputs[0].token_ids)
    return n


async def _drive(make_stream, requests: int, concurrency: int) -> tuple[float, int]:
    """(CPU seconds of this process, tokens read) for ``requests`` streams, ``concurrency`` at once."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with sem:
            return await _read(make_stream(i))

    cpu = time.process_time()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
    return time.process_time() - cpu, tokens


async def _measure(args, work: Path) -> list[dict]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from supervisor.states import State
    from tests.unit.test_supervisor_fake_engine import FakeEngine, FakeSupervisor, settings, wait_for

    FakeEngine.__init__.__defaults__ = (0.0,)  # instant steps: only the code on the path costs
    sup = FakeSupervisor(settings(work, standby="none"))
    owner = asyncio.create_task(sup.run())
    await wait_for(lambda: sup.state is State.READY, 30)
    engine = sup.engines[-1]
    rows = []

    def params(n: int = 1) -> SamplingParams:
        return SamplingParams(temperature=0 if n == 1 else 0.8, seed=None if n == 1 else 1, n=n,
                              max_tokens=args.tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    def prompt(i: int) -> dict:
        return {"type": "token", "prompt_token_ids": [1 + i % 50, 2, 3, 4]}

    paths = {
        "engine stream (vllm serve's front reads AsyncLLM so)": lambda i: engine.generate(prompt(i), params(), f"e{i}"),
        "daemon request path": lambda i: sup.client.generate(prompt(i), params(), f"d{i}"),
    }
    try:
        for r in range(args.rounds):
            for name, make in paths.items():
                cpu, tokens = await _drive(make, args.requests, args.concurrency)
                rows.append({"round": r, "path": name, "cpu_s": cpu, "tokens": tokens,
                             "us_per_token": 1e6 * cpu / tokens, "us_per_request": 1e6 * cpu / args.requests})
    finally:
        owner.cancel()
        await asyncio.gather(owner, return_exceptions=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.request_path", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    import uvloop

    from supervisor import logs

    logs.configure("info", "json")  # as the daemon logs by default: its per-request debug lines filtered out

    with tempfile.TemporaryDirectory() as work:  # on the daemon's event loop (supervisor.cli.run)
        rows = uvloop.run(_measure(args, Path(work)))
    med = {p: statistics.median(r["us_per_token"] for r in rows if r["path"] == p) for p in dict.fromkeys(r["path"] for r in rows)}
    base, daemon = list(med.values())
    lines = [f"{args.requests} requests x {args.tokens} tokens, {args.concurrency} at once, {args.rounds} rounds (median)"]
    lines += [f"  {p:55s} {v:7.2f} us CPU per token" for p, v in med.items()]
    lines.append(f"  added by the daemon: {daemon - base:.2f} us per token (ratio {daemon / base:.2f}x of the engine stream alone)")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "median_us_per_token": med}, indent=1))
        args.json.with_suffix(".md").write_text("# bench.request_path\n\n```\n" + "\n".join(lines) + "\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
