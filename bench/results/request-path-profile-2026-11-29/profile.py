"""``bench.request_path``'s load under cProfile (the thread's CPU clock): 400 requests of 128
tokens, 8 at once, over the unit tests' instant engine, read through the daemon's request path
(``daemon``) or from the engine's stream alone (``engine``); the top 25 functions by own time.

    .venv/bin/python bench/results/request-path-profile-2026-11-29/profile.py daemon|engine
"""

import asyncio
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository

from bench import request_path as rp  # noqa: E402


async def main():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from supervisor.states import State
    from tests.unit.test_supervisor_fake_engine import FakeEngine, FakeSupervisor, settings, wait_for
    FakeEngine.__init__.__defaults__ = (0.0,)
    sup = FakeSupervisor(settings(Path(tempfile.mkdtemp()), standby="none"))
    owner = asyncio.create_task(sup.run())
    await wait_for(lambda: sup.state is State.READY, 30)
    engine = sup.engines[-1]
    def params(): return SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    def prompt(i): return {"type": "token", "prompt_token_ids": [1 + i % 50, 2, 3, 4]}
    await rp._drive(lambda i: sup.client.generate(prompt(i), params(), f"w{i}"), 100, 8)
    which = sys.argv[1]
    make = (lambda i: sup.client.generate(prompt(i), params(), f"d{i}")) if which == "daemon" else (lambda i: engine.generate(prompt(i), params(), f"e{i}"))
    pr = cProfile.Profile(time.thread_time); pr.enable()
    cpu, tokens = await rp._drive(make, 400, 8)
    pr.disable()
    print(which, tokens, "tokens")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    owner.cancel(); await asyncio.gather(owner, return_exceptions=True)
import uvloop; uvloop.run(main())
