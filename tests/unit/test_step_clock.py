"""A busy engine's progress is its steps, not its tokens (``executor.steps``, ``health.probe``).

A long chunked prefill takes many steps and emits no token: not a hang, however long. An engine
that stops stepping with streams running is a hang after ``hang_timeout_s``, found within one
stall check more (``STALL_CHECK_S``), with no consecutive-failure threshold. An engine whose stats
are off (no steps reported) is judged by its tokens. The real vLLM stat-logger path is used: the
factory goes through ``StatLoggerManager`` as ``AsyncLLM`` builds it."""

from __future__ import annotations

import asyncio
import time

from executor.steps import StepClock
from health.probe import CONFIRM_S, STALL_CHECK_S, stalled
from supervisor.generation import Generation
from supervisor.states import State
from supervisor.events import EngineFailed
from tests.unit.test_supervisor_fake_engine import FakeBuilder, FakeEngine, FakeSupervisor, collect, reference, settings, wait_for


def generation(steps: StepClock | None) -> Generation:
    return Generation(1, "g1", object(), set(), 0.0, steps=steps)



class waiting:
    """A stream's reader waiting on the engine since ``since`` (``supervisor.stream.Reader``)."""

    def __init__(self, since: float, on_engine: bool = True):
        self.since, self.waiting = since, on_engine

    def get_name(self) -> str:
        return "r"

def test_the_clock_is_stamped_through_vllms_per_engine_logger_adapter():
    """As ``StatLoggerManager`` wraps a per-engine factory given to ``AsyncLLM(stat_loggers=...)``."""
    from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter

    clock = StepClock()
    before = clock.last_monotonic
    adapter = PerEngineStatLoggerAdapter(vllm_config=None, engine_indexes=[0], per_engine_stat_logger_factory=clock.factory())
    adapter.log_engine_initialized()
    adapter.record(scheduler_stats=None, iteration_stats=None)  # not a step
    assert clock.steps == 0 and not clock.ticking
    time.sleep(0.01)
    adapter.record(scheduler_stats=object(), iteration_stats=None)  # a step that made no token
    assert clock.steps == 1 and clock.ticking and clock.last_monotonic > before


def test_a_long_prefill_is_progress_a_stopped_engine_is_not():
    clock = StepClock()
    gen = generation(clock)
    now = time.monotonic()
    gen.readers.add(waiting(now - 20))  # a stream 20 s old
    gen.last_output_monotonic = now - 20  # and no token since it began
    clock.steps, clock.last_monotonic = 40, now - 1  # but the engine stepped a second ago (prefill chunks)
    assert stalled(gen, 4.0, now) is None
    clock.last_monotonic = now - 5  # no step for 5 s
    problem = stalled(gen, 4.0, now)
    assert problem is not None and problem.startswith("no engine step for 5.0 s with 1 stream(s)"), problem
    assert "last token 20.0 s ago" in problem
    gen.readers.clear()
    assert stalled(gen, 4.0, now) is None  # idle: the canary's business


def test_new_arrivals_do_not_hide_a_hang_and_a_new_stream_gets_its_time():
    clock = StepClock()
    gen = generation(clock)
    now = time.monotonic()
    clock.steps, clock.last_monotonic = 3, now - 60  # the engine last stepped a minute ago
    gen.last_output_monotonic = now - 60
    gen.readers.add(waiting(now - 2))  # the oldest stream arrived 2 s ago
    assert stalled(gen, 4.0, now) is None  # it has not waited hang_timeout_s yet
    gen.readers.add(waiting(now - 0.1))
    assert stalled(gen, 4.0, now + 2.5) is not None  # 4.5 s for the oldest: hung, arrivals or not


def test_a_new_generations_first_steps_may_compile_kernels():
    """A GPU kernel compiled on its first use (Triton, FlashInfer) runs inside a step: a new
    generation's first ``hang_first_steps`` steps get ``first_steps_timeout_s``, then the
    steady ``hang_timeout_s`` applies. On CPU the default is no grace at all."""
    from config.settings import GPU_FIRST_STEPS_TIMEOUT_S, SupervisorSettings

    clock = StepClock()
    gen = Generation(1, "g1", object(), set(), 0.0, steps=clock, first_steps=64, first_steps_timeout_s=90.0)
    now = time.monotonic()
    gen.readers.add(waiting(now - 60))
    gen.last_output_monotonic = now - 60
    clock.steps, clock.last_monotonic = 3, now - 30  # step 4 compiles for 30 s: not hung
    assert stalled(gen, 4.0, now) is None
    assert stalled(gen, 4.0, now + 61).startswith("no engine step for 91.0 s")  # past the grace: hung
    clock.steps = 64  # its first steps are done: the steady timeout
    assert stalled(gen, 4.0, now).startswith("no engine step for 30.0 s")

    cfg = SupervisorSettings()
    assert cfg.first_steps_timeout(cpu_platform=True) == cfg.hang_timeout_s == 4.0
    assert cfg.first_steps_timeout(cpu_platform=False) == GPU_FIRST_STEPS_TIMEOUT_S
    assert SupervisorSettings(hang_first_steps_timeout_s=20).first_steps_timeout(cpu_platform=True) == 20
    assert SupervisorSettings(hang_first_steps_timeout_s=2, hang_timeout_s=6).first_steps_timeout(cpu_platform=False) == 6


def test_without_steps_reported_tokens_are_the_clock():
    gen = generation(StepClock())  # stats off: never ticks
    now = time.monotonic()
    gen.readers.add(waiting(now - 10))
    gen.last_output_monotonic = now - 1
    assert stalled(gen, 4.0, now) is None
    gen.last_output_monotonic = now - 6
    assert stalled(gen, 4.0, now).startswith("no token for 6.0 s")
    bare = generation(None)  # no clock at all: the same
    bare.readers.add(waiting(now - 10))
    bare.last_output_monotonic = now - 6
    assert stalled(bare, 4.0, now).startswith("no token for 6.0 s")


class PrefillEngine(FakeEngine):
    """A fake engine whose first token comes only after ``prefill_s`` of steps (a long chunked
    prefill), each step stamped on its clock, unless ``stepping`` is cleared (a hang)."""

    def __init__(self, clock: StepClock, prefill_s: float):
        super().__init__()
        self.clock, self.prefill_s = clock, prefill_s
        self.stepping = True

    async def _generate(self, prompt, params):
        end = time.monotonic() + self.prefill_s
        while time.monotonic() < end or not self.stepping:
            await asyncio.sleep(0.05)
            if self.stepping:
                self.clock.last_monotonic, self.clock.steps = time.monotonic(), self.clock.steps + 1
        async for out in super()._generate(prompt, params):
            self.clock.last_monotonic, self.clock.steps = time.monotonic(), self.clock.steps + 1
            yield out


class PrefillBuilder(FakeBuilder):
    def __init__(self, prefill_s: float):
        super().__init__()
        self.prefill_s = prefill_s

    def build(self, number, standby=None, replica=0, start_workers=None):
        gen = super().build(number, standby, replica, start_workers)
        clock = StepClock()
        gen.engine = PrefillEngine(clock, self.prefill_s if number == 1 else 0.0)
        self.engines[-1] = gen.engine
        gen.steps = clock
        return gen


def test_a_prefill_longer_than_the_hang_timeout_finishes_and_a_stop_in_it_is_a_hang(tmp_path):
    async def scenario():
        # hang_timeout_s 0.5 s; the prefill steps for 1.5 s with no token: no recovery, exact output
        # (no idle canary in the test's time: it would sit in the same prefill)
        sup = FakeSupervisor(settings(tmp_path, probe_interval_s=30.0, probe_timeout_s=30.0), builder=PrefillBuilder(prefill_s=1.5))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        assert await collect(sup, [5], 6) == reference([5], 6)
        assert sup.recoveries == [], sup.recoveries
        # then the engine stops stepping in the middle of a prefill: a hang, found in time
        engine = sup.engines[0]
        posted: list[float] = []
        real_post = sup.post

        def spy(event):
            if isinstance(event, EngineFailed) and event.reason == "hang":
                posted.append(time.monotonic())
            real_post(event)

        sup.post = spy
        engine.prefill_s = 60.0
        started = time.monotonic()
        asyncio.get_running_loop().call_later(0.3, lambda: setattr(engine, "stepping", False))
        assert await collect(sup, [7], 6) == reference([7], 6)  # continued on the next generation
        assert sup.recoveries and sup.recoveries[0]["reason"] == "hang", sup.recoveries
        assert "no engine step for" in sup.recoveries[0]["detail"], sup.recoveries[0]
        took = posted[0] - started - 0.3
        assert 0.5 <= took <= 0.5 + STALL_CHECK_S + CONFIRM_S + 0.3, took  # hang_timeout_s + a check + its confirmation
        owner.cancel()

    asyncio.run(scenario())


def test_a_paused_engine_is_not_hung_and_its_stream_waits_from_the_resume(tmp_path):
    """vLLM's ``pause_generation`` (``/pause``) holds the engines on purpose: a stream that waits
    on a paused engine for 3 × ``hang_timeout_s`` is not a hang, and its wait is counted from
    the resume; a stop after the resume is still found."""
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path, probe_interval_s=30.0, probe_timeout_s=30.0), builder=PrefillBuilder(prefill_s=0.0))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        engine = sup.engines[0]

        async def pause(**kwargs):
            engine.stepping = False

        async def resume():
            engine.stepping = True

        engine.pause_generation, engine.resume_generation = pause, resume
        await sup.client.pause_generation(mode="keep")
        assert sup.client.holds == {"pause"}
        stream = asyncio.ensure_future(collect(sup, [5], 6))
        await asyncio.sleep(1.5)  # hang_timeout_s is 0.5 s
        assert sup.recoveries == [] and not stream.done()
        await sup.client.resume_generation()
        assert await stream == reference([5], 6)
        assert sup.recoveries == [] and sup.client.holds == set()
        engine.stepping = False  # now a real stop, after the resume
        assert await collect(sup, [7], 6) == reference([7], 6)  # continued on the next generation
        assert [r["reason"] for r in sup.recoveries] == ["hang"], sup.recoveries
        owner.cancel()

    asyncio.run(scenario())


def test_an_idle_engine_gets_a_canary_every_canary_interval_s_not_every_probe(tmp_path):
    """The cheap checks run every ``probe_interval_s``; the canary (an engine step) only after
    ``canary_interval_s`` of quiet, and a request's steps count as quiet ended."""
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path, probe_interval_s=0.05, canary_interval_s=0.5))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        engine = sup.engines[0]
        seen: list[tuple[float, str]] = []
        generate = engine.generate

        def recording(prompt, params, request_id):
            seen.append((time.monotonic(), request_id))
            return generate(prompt, params, request_id)

        engine.generate = recording
        await asyncio.sleep(2.2)
        canaries = [t for t, rid in seen if rid.startswith("probe-")]
        assert 3 <= len(canaries) <= 5, canaries  # every 0.5 s, not every 0.05 s probe
        assert all(b - a >= 0.45 for a, b in zip(canaries, canaries[1:])), canaries
        assert sup.recoveries == []
        owner.cancel()

    asyncio.run(scenario())


def test_a_lost_ring_wakeup_costs_at_most_a_second():
    """The executors bound how long a ring reader that missed its notification waits before it
    re-reads (vLLM: 5 s), so a healthy step is never late by more than hang_timeout_s allows."""
    import executor.ray_v2  # noqa: F401 - the engine core and the workers import it
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from config import SupervisorSettings
    from executor.canary import READER_RECHECK_MS

    wait = MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=False)
    assert wait.timeout_ms() == READER_RECHECK_MS == 1000  # what an idle reader waits, per wake-up
    assert SupervisorSettings().hang_timeout_s >= 3 * READER_RECHECK_MS / 1000


def test_a_reader_waiting_on_its_client_is_not_waiting_on_the_engine():
    """A client that reads slowly keeps its reader between outputs (vLLM's collector holds what
    the engine made meanwhile): the engine is not hung for it, and an engine that finished
    every request is idle however slowly its clients read."""
    gen = generation(StepClock())
    now = time.monotonic()
    gen.last_output_monotonic = now - 60
    gen.readers.add(waiting(now - 60, on_engine=False))
    assert stalled(gen, 4.0, now) is None
    gen.readers.add(waiting(now - 5))  # another stream has waited 5 s on no token
    assert stalled(gen, 4.0, now).startswith("no token for 5.0 s with 2 stream(s)")
