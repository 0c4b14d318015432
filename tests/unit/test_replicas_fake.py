"""Replicas against fake engines: routing by least streams, live migration of a failed
replica's streams to a serving one (before the failed one is rebuilt), recovery in the
background, and every replica failing. No Ray, no vLLM engine."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from supervisor.dispatch import ready
from supervisor.events import EngineFailed, SignalReceived
from supervisor.replica import pick
from supervisor.states import State
from supervisor.suspects import ESTABLISHED
from tests.unit.test_supervisor_fake_engine import FakeBuilder, FakeSupervisor, reference, run, settings, wait_for


class SlowRebuilds(FakeBuilder):
    """First builds are quick; rebuilds take ``rebuild_s`` (a real one takes tens of seconds)."""

    rebuild_s = 1.5

    def build(self, number, standby=None, replica=0, start_workers=None):
        if number > 2:
            time.sleep(self.rebuild_s)
        gen = super().build(number, standby, replica, start_workers)
        gen.replica = replica
        return gen


class HeldRebuilds(SlowRebuilds):
    """Rebuilds wait for ``gate``: a test decides when the failed replica comes back."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.rebuilds_done: list[int] = []

    def build(self, number, standby=None, replica=0, start_workers=None):
        if number > 2:
            assert self.gate.wait(30), "the test never released the rebuild"
        gen = FakeBuilder.build(self, number, standby, replica, start_workers)
        gen.replica = replica
        if number > 2:
            self.rebuilds_done.append(number)
        return gen


async def stream(sup, prompt, n, request_id, on_token=None):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    got = []
    async for out in sup.client.generate({"prompt_token_ids": prompt}, params, request_id):
        got += out.outputs[0].token_ids
        if on_token:
            on_token(len(got))
    return got


def kill(sup, index):
    gen = sup.replicas[index].current
    gen.engine.die()
    sup.post(EngineFailed(gen.number, "worker_death", f"replica {index} rank 0 killed by `ray.kill`", ranks=(0,)))


async def two_replicas(tmp_path, builder=None):
    sup = FakeSupervisor(settings(tmp_path, replicas=2), builder=builder or SlowRebuilds())
    states = []
    sup.machine.on_transition.append(lambda old, new, reason: states.append(new))
    owner = asyncio.create_task(sup.run())
    await wait_for(lambda: all(r.serving() for r in sup.replicas))
    return sup, owner, states


def test_pick_takes_the_replica_with_fewest_streams():
    from supervisor.replica import ReplicaView
    from supervisor.states import ReplicaState
    from types import SimpleNamespace

    def gen(n, streams, failed=False, epoch=0):
        return SimpleNamespace(number=n, readers=dict.fromkeys(range(streams)), failed=failed, epoch=epoch)

    def Replica(index, current):  # as the owner's snapshot shows a serving replica
        return ReplicaView(index, ReplicaState.SERVING, current, True)

    a, b, c = Replica(0, gen(1, 3)), Replica(1, gen(2, 1)), Replica(2, gen(3, 0, failed=True))
    assert pick([a, b, c]) is b.current
    assert pick([a, b, c], not_gens=(b.current,)) is a.current
    assert pick([c]) is None
    # a rolling reload: once the front serves epoch 1, only epoch-1 generations take requests
    d = Replica(3, gen(4, 5, epoch=1))
    assert pick([a, b, d], epoch=1) is d.current and pick([a, b, d], epoch=0) is b.current


def test_a_failed_replicas_streams_move_to_the_other_at_once(tmp_path):
    async def scenario():
        sup, owner, states = await two_replicas(tmp_path)
        assert sup.state is State.READY and [r.current.number for r in sup.replicas] == [1, 2]
        killed_at = []

        def kill_replica_0(n):
            if n == 6 and not killed_at:
                killed_at.append(time.monotonic())
                kill(sup, 0)

        prompts = [[i + 1, 2, 3] for i in range(6)]
        tasks = [asyncio.create_task(stream(sup, p, 40, f"r{i}", kill_replica_0 if i == 0 else None))
                 for i, p in enumerate(prompts)]
        got = await asyncio.gather(*tasks)
        done_at = time.monotonic()
        assert got == [reference(p, 40) for p in prompts]
        # Least streams: three on each replica's first engine.
        assert len(sup.engines[0].requests_seen) and len(sup.engines[1].requests_seen)
        # Every stream finished before replica 0's rebuild (1.5 s) could have served them.
        assert done_at - killed_at[0] < SlowRebuilds.rebuild_s
        assert sup.outcomes["continued"] == 3 and sup.outcomes["ok"] == 3
        assert State.RECOVERING not in states  # replica 1 served throughout
        assert sup.replicas[0].word == "recovering"
        await wait_for(lambda: sup.replicas[0].serving())
        assert sup.replicas[0].current.number == 3 and sup.replicas[1].current.number == 2
        assert sup.torn_down == [1] and sup.restarts["worker_death"] == 1
        assert sup.recoveries[0]["replica"] == 0 and sup.recoveries[0]["to_generation"] == 3
        status = sup.status()
        assert [r["state"] for r in status["replicas"]] == ["serving", "serving"]
        assert sup.metrics.replica_up.labels("0")._value.get() == 1
        assert sup.metrics.restarts.labels("0", "worker_death")._value.get() == 1
        assert sup.metrics.restarts.labels("1", "worker_death")._value.get() == 0
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0
        assert sorted(sup.torn_down) == [1, 2, 3]

    run(scenario())


def test_both_replicas_killed_one_after_the_other(tmp_path):
    async def scenario():
        sup, owner, states = await two_replicas(tmp_path)
        prompts = [[i + 1, 5] for i in range(4)]
        first = [asyncio.create_task(stream(sup, p, 30, f"a{i}", (lambda n: n == 5 and kill(sup, 0)) if i == 0 else None))
                 for i, p in enumerate(prompts)]
        assert await asyncio.gather(*first) == [reference(p, 30) for p in prompts]
        await wait_for(lambda: sup.replicas[0].serving())
        second = [asyncio.create_task(stream(sup, p, 30, f"b{i}", (lambda n: n == 5 and kill(sup, 1)) if i == 0 else None))
                  for i, p in enumerate(prompts)]
        assert await asyncio.gather(*second) == [reference(p, 30) for p in prompts]
        await wait_for(lambda: sup.replicas[1].serving())
        assert [r.current.number for r in sup.replicas] == [3, 4]
        assert State.RECOVERING not in states and sup.outcomes["failed"] == 0
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    run(scenario())


def test_with_every_replica_down_streams_wait_for_the_first_back(tmp_path):
    async def scenario():
        sup, owner, states = await two_replicas(tmp_path)
        SlowRebuilds.rebuild_s = 0.3
        try:
            def kill_both(n):
                if n == 5:
                    kill(sup, 0)
                    kill(sup, 1)

            prompts = [[7, i] for i in range(4)]
            got = await asyncio.gather(*(stream(sup, p, 30, f"c{i}", kill_both if i == 0 else None)
                                         for i, p in enumerate(prompts)))
            assert got == [reference(p, 30) for p in prompts]
            assert State.RECOVERING in states and sup.state is State.READY
            await wait_for(lambda: all(r.serving() for r in sup.replicas))
        finally:
            SlowRebuilds.rebuild_s = 1.5
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    run(scenario())


def test_parked_streams_move_to_the_other_replica_while_draining(tmp_path):
    """A replica that fails while the daemon drains: its streams (admitted before the drain)
    continue on the other replica at once, while the failed one's rebuild is still held."""
    builder = HeldRebuilds()

    async def scenario():
        sup, owner, states = await two_replicas(tmp_path, builder)
        moved = []

        async def drain_then_kill():
            # every stream established on its engine (supervisor.suspects): none is a suspect of the kill
            await wait_for(lambda: sum(len(r.current.readers) for r in sup.replicas) == 4 and all(
                c.suspect.outputs_here >= ESTABLISHED for r in sup.replicas for c in r.current.choices.values()))
            assert (await sup._submit("drain", {}))["ok"]
            moved.append(len(sup.replicas[0].current.readers))
            kill(sup, 0)

        prompts = [[3, i] for i in range(4)]
        killer = asyncio.create_task(drain_then_kill())
        try:
            got = await asyncio.wait_for(asyncio.gather(*(stream(sup, p, 60, f"d{i}") for i, p in enumerate(prompts))), 5)
        except asyncio.TimeoutError:
            raise AssertionError(f"streams did not finish while replica 0's rebuild was held: they waited for it "
                                 f"instead of moving to replica 1 (status {sup.status()['replicas']})") from None
        await killer
        assert got == [reference(p, 60) for p in prompts]  # admitted before the drain: continued on replica 1
        # every stream ended while replica 0's rebuild was still held: none waited for it
        assert builder.rebuilds_done == [] and sup.replicas[0].word == "recovering", (builder.rebuilds_done, sup.status()["replicas"])
        assert moved == [2], moved  # least streams: two on each replica when replica 0 failed
        assert sup.outcomes["continued"] == 2 and sup.outcomes["ok"] == 2 and sup.outcomes["failed"] == 0, sup.outcomes
        assert sup.state is State.DRAINING and State.RECOVERING not in states
        builder.gate.set()
        await wait_for(lambda: sup.replicas[0].serving())
        assert builder.rebuilds_done == [3] and sup.replicas[1].current.number == 2
        assert (await sup._submit("resume", {}))["ok"]
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    try:
        run(scenario())
    finally:
        builder.gate.set()  # never leave a build thread waiting


def test_restart_rebuilds_replicas_one_after_another_while_the_other_serves(tmp_path):
    async def scenario():
        sup, owner, states = await two_replicas(tmp_path)
        SlowRebuilds.rebuild_s = 0.3
        try:
            prompts = [[9, i] for i in range(4)]
            tasks = [asyncio.create_task(stream(sup, p, 150, f"e{i}")) for i, p in enumerate(prompts)]
            await wait_for(lambda: sum(len(r.current.readers) for r in sup.replicas) == 4)
            assert (await sup._submit("restart", {}))["ok"]
            assert await asyncio.gather(*tasks) == [reference(p, 150) for p in prompts]
            await wait_for(lambda: not sup.owner.busy() and all(r.serving() for r in sup.replicas), timeout_s=15)
        finally:
            SlowRebuilds.rebuild_s = 1.5
        assert sorted(r.current.number for r in sup.replicas) == [3, 4]
        assert State.RECOVERING not in states and State.DRAINING not in states  # no drain, never without an engine
        assert sup.outcomes["failed"] == 0 and sup.restarts["operator"] == 2
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    run(scenario())


class FailingReplica(SlowRebuilds):
    """Builds of the replicas in ``failing`` fail (a replica that cannot be placed)."""

    rebuild_s = 0.05

    def __init__(self):
        super().__init__()
        self.failing: set[int] = set()

    def build(self, number, standby=None, replica=0, start_workers=None):
        if replica in self.failing:
            time.sleep(0.02)
            self.claims.append((number, standby))
            raise RuntimeError(f"PlacementGroupTimeout: replica {replica} not placed (fake)")
        return super().build(number, standby, replica, start_workers)


def budget_spent(sup, index) -> float:
    return sup.metrics.replica_budget_spent.labels(str(index))._value.get()


def test_the_standby_serves_whichever_replica_fails_first(tmp_path):
    """One standby for both: prepared for the next number, adopted by replica 1's rebuild,
    prepared again on replica 1's nodes, then adopted by replica 0's."""
    async def scenario():
        b = SlowRebuilds()
        sup, owner, states = await two_replicas(tmp_path, builder=b)
        await wait_for(lambda: sup.standby.state.value == "ready")
        assert sup.standby.generation == 3 and sorted(c[0] for c in b.claims) == [1, 2]
        prompts = [[3, i] for i in range(4)]
        got = await asyncio.gather(*(stream(sup, p, 30, f"s{i}", (lambda n: n == 5 and kill(sup, 1)) if i == 0 else None)
                                     for i, p in enumerate(prompts)))
        assert got == [reference(p, 30) for p in prompts]
        await wait_for(lambda: sup.replicas[1].serving() and sup.standby.state.value == "ready")
        assert sup.replicas[1].current.number == 3 and b.serving[3] == b.standby_made[0]["actor_id"]
        assert sup.standby.generation == 4 and sup.standby.replica == 1  # placed on the nodes of the one that came up
        kill(sup, 0)
        await wait_for(lambda: sup.replicas[0].serving() and sup.replicas[0].current.number == 4)
        assert sup.replicas[0].current.number == 4 and b.serving[4] == b.standby_made[1]["actor_id"]
        assert sup.standby.adoptions == {"adopted": 2, "cold": 0}
        assert State.RECOVERING not in states
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    run(scenario())


def test_a_replica_that_cannot_be_built_waits_while_the_other_serves(tmp_path):
    """Its own restart budget spent, replica 1 waits ("waiting", the metric, why) while
    replica 0 serves every request; it serves again once its budget has room and it can be
    built. The daemon fails (exit 3) only when no replica serves or can."""
    async def scenario():
        b = FailingReplica()
        sup = FakeSupervisor(settings(tmp_path, replicas=2, max_restarts=2, restart_window_s=1.5), builder=b)
        states = []
        sup.machine.on_transition.append(lambda old, new, reason: states.append(new))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: all(r.serving() for r in sup.replicas))
        b.failing.add(1)
        kill(sup, 1)
        await wait_for(lambda: sup.replicas[1].word == "waiting", 5)
        status = sup.status()["replicas"][1]
        assert status["state"] == "waiting" and 0 < status["retry_in_s"] <= 1.5, status
        assert "not placed" in status["last_error"] and budget_spent(sup, 1) == 1
        assert sup.state is State.READY and ready(sup)
        prompts = [[5, i] for i in range(3)]
        assert await asyncio.gather(*(stream(sup, p, 20, f"w{i}") for i, p in enumerate(prompts))) == \
            [reference(p, 20) for p in prompts]
        b.failing.clear()  # capacity is back: the next try after the window succeeds
        await wait_for(lambda: sup.replicas[1].serving(), 5)
        assert budget_spent(sup, 1) == 0 and "last_error" not in sup.status()["replicas"][1]
        assert State.RECOVERING not in states and sup.state is State.READY

        b.failing.update({0, 1})  # now neither can be built: the daemon fails
        kill(sup, 1)
        await wait_for(lambda: sup.replicas[1].word == "waiting", 5)
        assert sup.state is State.READY
        kill(sup, 0)
        assert await asyncio.wait_for(owner, 10) == 3
        assert sup.state is State.FAILED and "no other replica serves" in sup.machine.reason

    run(scenario())


def test_the_standby_is_left_alone_by_builds_that_are_not_its_own():
    """Only the build of the standby's reserved number adopts it: a build of another number
    (one placed while another adopts it) gets the fork server only; the standby is not touched."""
    from supervisor.standby import Standby, StandbyState
    from tests.unit.test_supervisor_fake_engine import FakeBuilder
    from health.metrics import SupervisorMetrics
    from prometheus_client import CollectorRegistry

    async def scenario():
        b = FakeBuilder()
        b.forkserver_up = True
        sb = Standby(b.standby_workers, SupervisorMetrics(1, CollectorRegistry()), enabled=True)
        assert sb.prepare(5, None, replica=1) and sb.reserved() == 5
        await wait_for(lambda: sb.state is StandbyState.READY)
        made = b.standby_made[0]
        assert await sb.claim(4) == {"namespace": None, "forkserver": True}
        assert sb.state is StandbyState.READY and b.actor_states[made["actor_id"]] == "ALIVE"
        assert await sb.claim(5) == {"namespace": "fake-ns", "forkserver": True} and sb.state is StandbyState.ADOPTING
        assert sb.reserved() is None and not sb.prepare(7, None)  # taken; the next build numbers anew
        assert await sb.claim(6) == {"namespace": None, "forkserver": True}
        assert sb.state is StandbyState.ADOPTING and b.actor_states[made["actor_id"]] == "ALIVE"
        assert sb.adopted(6, [{"rank": 0, "actor_id": "cold"}])["result"] == "cold"
        sb.build_failed(6)
        assert sb.state is StandbyState.ADOPTING  # not the build that claimed it
        assert sb.adopted(5, [{"rank": 0, "actor_id": made["actor_id"]}]) == {"result": "adopted", "adopted_ranks": [0]}
        assert sb.state is StandbyState.OFF and sb.adoptions == {"adopted": 1, "cold": 1}

    run(scenario())
