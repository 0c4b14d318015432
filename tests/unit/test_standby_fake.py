"""The warm standby's logic over the fake builder (``FakeBuilder`` simulates the fork server
and the standby actors; the real ones are exercised by ``tests/chaos/test_standby.py``)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from supervisor.events import EngineFailed, SignalReceived
from supervisor.standby import TRANSITIONS, StandbyState
from supervisor.states import State
from tests.unit.test_supervisor_fake_engine import FakeSupervisor, collect, reference, run, settings, wait_for


async def started_with_standby(tmp_path):
    """A fake daemon whose first engine serves and whose standby is ready: (daemon, builder, owner task)."""
    sup = FakeSupervisor(settings(tmp_path))
    owner = asyncio.create_task(sup.run())
    await wait_for(lambda: sup.standby.state is StandbyState.READY)
    return sup, sup.builder, owner


def run_killing(scenario, procs: dict) -> None:
    """Run ``scenario``, then kill every process it started into ``procs``, however it ended."""
    try:
        run(scenario)
    finally:
        for p in procs.values():
            if p is not None:
                p.kill()
                p.wait()


def test_standby_is_prepared_adopted_and_prepared_again(tmp_path):
    async def scenario():
        sup, b, owner = await started_with_standby(tmp_path)
        assert b.claims[0] == (1, {"namespace": None, "forkserver": False})  # the first start is cold
        assert sup.standby.generation == 2 and b.forkserver_up
        assert sup.status()["standby"]["workers"][0]["state"] == "ALIVE"

        def kill_at_5(n):
            if n == 5:
                sup.engines[0].die()
                sup.post(EngineFailed(1, "worker_death", "rank 0 killed"))

        assert await collect(sup, [1, 2], 20, kill_at_5) == reference([1, 2], 20)
        assert b.claims[1] == (2, {"namespace": "fake-ns", "forkserver": True})
        assert b.serving[2] == b.standby_made[0]["actor_id"]  # generation 2 runs in the standby
        # it was parked once ready, and woken by the claim before the build called it
        assert b.woken == [b.standby_made[0]["actor_id"]] and b.adopted_parked == []
        assert sup.recoveries[0]["standby"] == {"result": "adopted", "adopted_ranks": [0]}
        assert sup.standby.adoptions == {"adopted": 1, "cold": 0}
        await wait_for(lambda: sup.standby.state is StandbyState.READY and sup.standby.generation == 3)
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0
        assert sup.standby.state is StandbyState.OFF and not b.forkserver_up
        assert all(b.actor_states[w["actor_id"]] == "DEAD" for w in b.standby_made[1:])  # the unused one is killed

    run(scenario())


def test_dead_standby_is_replaced_without_a_recovery(tmp_path):
    async def scenario():
        sup, b, owner = await started_with_standby(tmp_path)
        b.actor_states[b.standby_made[0]["actor_id"]] = "DEAD"  # the standby actor dies
        await wait_for(lambda: sup.standby.replacements == 1 and sup.standby.state is StandbyState.READY, 10)
        assert len(b.standby_made) == 2 and sup.standby.workers[0]["actor_id"] == b.standby_made[1]["actor_id"]
        assert sup.state is State.READY and sup.generation_number == 1 and not sup.recoveries
        assert sup.metrics.standby_replacements._value.get() == 1
        b.forkserver_up = False  # the fork server dies too
        await wait_for(lambda: sup.standby.replacements == 2 and b.forkserver_up, 10)
        owner.cancel()

    run(scenario())


def test_ray_error_while_watching_makes_it_unavailable_then_ready_again(tmp_path, monkeypatch):
    import supervisor.standby as standby_module

    monkeypatch.setattr(standby_module, "RETRY_S", (0.05, 0.1))

    async def scenario():
        sup, b, owner = await started_with_standby(tmp_path)
        real, calls = b.standby_workers.states, []

        def flaky(workers):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("GCS unavailable (fake)")
            return real(workers)

        b.standby_workers.states = flaky
        await wait_for(lambda: sup.standby.last_error.startswith("RuntimeError: GCS unavailable"), 10)
        await wait_for(lambda: sup.standby.state is StandbyState.READY and len(b.standby_made) == 2, 10)
        assert sup.state is State.READY and not sup.recoveries
        owner.cancel()

    run(scenario())


def test_a_failed_build_falls_back_to_a_cold_one(tmp_path):
    async def scenario():
        sup, b, owner = await started_with_standby(tmp_path)
        b.build_failures = 1  # the build that adopts the standby fails
        sup.engines[0].die()
        sup.post(EngineFailed(1, "worker_death", "rank 0 killed"))
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 3)
        assert [c[0] for c in b.claims] == [1, 2, 3]
        assert b.claims[2][1] == {"namespace": None, "forkserver": True}  # no standby for 3: cold workers,
        # started by the build itself beside its engine core (StandbyWorkers.starter), as the first build's were
        assert [w["name"] for w in b.started_early] == ["w-g1", "w-g3"]
        assert b.serving[3] == b.started_early[-1]["actor_id"] and sup.standby.adoptions == {"adopted": 0, "cold": 1}
        await wait_for(lambda: sup.standby.state is StandbyState.READY and sup.standby.generation == 4)
        owner.cancel()

    run(scenario())


def test_standby_none_prepares_nothing(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path, standby="none"))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        await asyncio.sleep(0.2)
        assert sup.standby.state is StandbyState.OFF and not sup.builder.standby_made and not sup.builder.forkserver_up
        assert sup.builder.claims == [(1, None)]
        assert sup.status()["standby"]["mode"] == "none"
        owner.cancel()

    run(scenario())


def test_standby_transition_table_is_closed():
    for state, targets in TRANSITIONS.items():
        assert state not in targets and targets <= set(StandbyState)
    assert set(TRANSITIONS) == set(StandbyState)


def test_the_standby_waits_for_the_resumed_streams_before_it_starts(tmp_path, monkeypatch):
    """After READY the standby is PREPARING at once (a failure claims it) but starts nothing
    for SETTLE_S: the first seconds' cores are the resumed streams'."""
    import supervisor.standby as standby_module

    monkeypatch.setattr(standby_module, "SETTLE_S", 0.5)

    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        ready_at = asyncio.get_running_loop().time()
        assert sup.standby.state is StandbyState.PREPARING
        await asyncio.sleep(0.3)
        assert sup.builder.standby_made == [] and not sup.builder.forkserver_up
        await wait_for(lambda: sup.standby.state is StandbyState.READY)
        # ``ready_at`` is when the poll (every 10 ms) saw READY, up to a poll after the settle began
        assert asyncio.get_running_loop().time() - ready_at >= 0.5 - 0.02
        sup.post(SignalReceived(signal.SIGTERM))
        await owner

    run(scenario())


def test_a_failed_start_of_the_builds_own_workers_leaves_none_and_the_build_goes_on(tmp_path):
    """``WorkerStarter``: the creation raised (some ranks may have been made): whatever carries
    the generation's name is killed, and vLLM creates the workers."""
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))

        def fails(number, vllm_config, replica=0):
            raise RuntimeError("the agent's call broke after rank 0 was made")

        sup.builder.standby_workers.create = fails
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        assert sup.builder.serving[1] == "cold-1" and sup.builder.started_early == []
        assert sup.builder.ray.killed_instances[:1] == ["fake-g1"]
        owner.cancel()

    run(scenario())


def test_a_bench_can_leave_each_standby_part_out_only_with_the_hooks_on(tmp_path, monkeypatch):
    """``VLLM_SUPERVISOR_TEST_STANDBY_WITHOUT`` (bench.serving_overhead measures the parts apart):
    ``starter``, the build's workers made by vLLM's executor; ``idle``, no standby after the build;
    ``poll``, a ready standby not watched; ``preload``, the workers' class not imported ahead;
    ``park``, a ready standby's workers not parked. Without the hooks' switch it changes nothing."""
    from supervisor import testhooks

    async def started(without: str, hooks: str = "1"):
        monkeypatch.setenv(testhooks.ENV, hooks)
        monkeypatch.setenv(testhooks.STANDBY_WITHOUT_ENV, without)
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        return sup, owner

    async def scenario():
        sup, owner = await started("starter")
        await wait_for(lambda: sup.standby.state is StandbyState.READY)
        assert sup.builder.serving[1] == "cold-1" and sup.builder.started_early == []
        owner.cancel()

        sup, owner = await started("idle")
        await asyncio.sleep(0.3)
        assert sup.builder.serving[1] != "cold-1" and len(sup.builder.started_early) == 1
        assert sup.standby.state is StandbyState.OFF and not sup.builder.standby_made and not sup.builder.forkserver_up
        owner.cancel()

        sup, owner = await started("poll")
        await wait_for(lambda: sup.standby.state is StandbyState.READY)
        assert sup.standby.preloads_worker_class  # the agent imports the workers' class ahead, unless:
        sup.builder.actor_states[sup.builder.standby_made[0]["actor_id"]] = "DEAD"
        await asyncio.sleep(2.5)  # watched, it is replaced within about 2 s (the test above)
        assert sup.standby.replacements == 0 and len(sup.builder.standby_made) == 1
        owner.cancel()

        sup, owner = await started("park")
        await wait_for(lambda: sup.standby.state is StandbyState.READY)
        assert sup.builder.parked == set() and "wake" not in sup.standby.workers[0]  # waits awake
        owner.cancel()

        sup, owner = await started("starter,idle,preload")
        assert sup.standby.creates_workers and not sup.standby.preloads_worker_class
        owner.cancel()

        sup, owner = await started("idle,preload", hooks="")  # the hooks off: a default standby
        await wait_for(lambda: sup.standby.state is StandbyState.READY)
        assert sup.standby.preloads_worker_class
        owner.cancel()

    run(scenario())
    monkeypatch.setenv(testhooks.ENV, "1")
    monkeypatch.setenv(testhooks.STANDBY_WITHOUT_ENV, "starter,idel")
    with pytest.raises(ValueError, match="idel"):
        testhooks.standby_without()


def test_wake_connects_once_to_each_parked_worker_and_names_those_it_cannot_reach():
    """``StandbyWorkers.wake`` (the claim's wake-up of a parked standby, ``executor.standby.park``):
    one connection to each worker's address; a worker it cannot reach is named, not raised, and a
    worker that was never parked is left alone."""
    import socket

    from supervisor.standby_workers import StandbyWorkers

    listener = socket.create_server(("127.0.0.1", 0))
    gone = socket.create_server(("127.0.0.1", 0))
    gone_address = gone.getsockname()
    gone.close()
    workers = [{"name": "w0", "wake": listener.getsockname()}, {"name": "w1", "wake": gone_address}, {"name": "w2"}]
    missed = StandbyWorkers.wake(workers)
    assert len(missed) == 1 and missed[0].startswith("w1: ConnectionRefusedError"), missed
    listener.setblocking(False)
    listener.accept()[0].close()  # w0's one connection is there
    with pytest.raises(BlockingIOError):
        listener.accept()  # and only one
    listener.close()


def test_a_ready_standby_on_this_host_is_waited_on_not_polled(tmp_path, monkeypatch):
    """The ready standby's processes on the daemon's host (its fork server, the workers Ray
    placed on this node) are waited on (``supervisor.process_exits``): one that exits is
    replaced at once, with Ray's table read only every ``CHECK_S`` and still saying ALIVE. A
    worker on another node is polled."""
    import subprocess
    import sys

    import supervisor.standby as standby_module

    monkeypatch.setattr(standby_module, "POLL_S", 60.0)
    monkeypatch.setattr(standby_module, "CHECK_S", 60.0)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    procs: dict[str, subprocess.Popen] = {}
    local = {"worker": True}

    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        host, b = sup.builder.standby_workers, sup.builder
        fake_states = host.states

        def process(key, again=False):
            if key not in procs or again:
                procs.setdefault(f"{key}-{len(procs)}", procs.pop(key, None))  # killed at the end
                procs[key] = subprocess.Popen(sleeper)
            return procs[key]

        def states(workers):  # the fake's table, with a real process for each worker
            return [dict(s, pid=process(w["actor_id"]).pid, local=local["worker"])
                    for w, s in zip(workers, fake_states(workers))]

        host.states = states
        host.start_forkserver = lambda: process("forkserver", again=True) and 0.01
        host.forkserver_alive = lambda: "forkserver" in procs and procs["forkserver"].poll() is None
        host.forkserver_pid = lambda: procs["forkserver"].pid if host.forkserver_alive() else None
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.standby.state is StandbyState.READY and sup.standby.watch == "exits", 10)
        assert sup.status()["standby"]["watch"] == "exits"

        worker = procs[b.standby_made[0]["actor_id"]]
        worker.kill()
        await wait_for(lambda: sup.standby.replacements == 1 and sup.standby.state is StandbyState.READY, 5)
        assert b.actor_states[b.standby_made[0]["actor_id"]] == "DEAD"  # discarded through Ray
        assert len(b.standby_made) == 2 and sup.standby.workers[0]["pid"] == procs[b.standby_made[1]["actor_id"]].pid

        server = procs["forkserver"]
        server.kill()  # not reaped here: a zombie has exited too
        await wait_for(lambda: sup.standby.replacements == 2 and sup.standby.state is StandbyState.READY, 5)
        assert sup.standby.forkserver_pid == procs["forkserver"].pid != server.pid
        assert sup.state is State.READY and not sup.recoveries

        local["worker"] = False  # the next standby's worker runs on another node: polled
        procs[sup.standby.workers[0]["actor_id"]].kill()
        await wait_for(lambda: sup.standby.replacements == 3 and sup.standby.state is StandbyState.READY
                       and sup.standby.watch == "polled", 5)
        owner.cancel()
        await asyncio.gather(owner, return_exceptions=True)

    run_killing(scenario(), procs)


def test_a_host_without_pidfds_polls_the_standby_and_still_replaces_a_dead_one(tmp_path, monkeypatch):
    """Where ``pidfd_open`` is refused (a kernel before 5.3, a seccomp filter), the ready
    standby's processes cannot be waited on: it is polled through Ray's table every ``POLL_S``
    (the status says so) and a death seen there is still replaced without a recovery."""
    import errno
    import os

    import supervisor.standby as standby_module

    def refused(pid, flags=0):
        raise OSError(errno.ENOSYS, "pidfd_open refused")

    monkeypatch.setattr(standby_module, "POLL_S", 0.05)
    monkeypatch.setattr(standby_module, "CHECK_S", 60.0)

    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        host, b = sup.builder.standby_workers, sup.builder
        fake_states = host.states
        # every part on this host, with a pid that lives: with pidfds this standby is waited on
        host.states = lambda workers: [dict(s, pid=os.getpid(), local=True) for s in fake_states(workers)]
        host.forkserver_pid = lambda: os.getpid()
        monkeypatch.setattr(os, "pidfd_open", refused)
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.standby.state is StandbyState.READY and sup.standby.watch, 10)
        assert sup.status()["standby"]["watch"] == "polled"
        b.actor_states[b.standby_made[0]["actor_id"]] = "DEAD"  # seen only in the table
        await wait_for(lambda: sup.standby.replacements == 1 and sup.standby.state is StandbyState.READY, 5)
        assert sup.state is State.READY and not sup.recoveries
        owner.cancel()
        await asyncio.gather(owner, return_exceptions=True)

    run(scenario())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # the daemon's is uvloop's (supervisor.cli)
def test_process_exits_sees_an_exit_a_zombie_and_a_pid_already_gone(loop):
    import subprocess
    import sys

    from supervisor.process_exits import ProcessExits

    async def scenario():
        live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()  # reaped: its pid names no process (nor, this soon, a new one)
        while True:  # exited, not reaped
            with open(f"/proc/{zombie.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            await asyncio.sleep(0.01)
        try:
            with ProcessExits({"gone": gone.pid}) as exits:
                assert exits.exited == ["gone"]  # at once
            with ProcessExits({"live": live.pid, "zombie": zombie.pid}) as exits:
                assert await exits.wait(5) == ["zombie"]
            with ProcessExits({"live": live.pid}) as exits:
                assert await exits.wait(0.2) == []
                live.kill()
                assert await exits.wait(5) == ["live"]
        finally:
            for p in (live, zombie):
                p.kill()
                p.wait()

    if loop == "uvloop":
        import uvloop

        uvloop.run(scenario())
    else:
        run(scenario())


def test_a_ready_standby_rests_and_each_claim_takes_back_what_its_build_uses(tmp_path, monkeypatch):
    """Once ready, the standby's processes on this host rest under SCHED_IDLE
    (``supervisor.standby_sched``: they run only on a core nothing else wants); the claim of the
    build it is kept for sets them back before the build adopts a worker or forks its engine core
    from the fork server, and the next ready standby rests again. Another build's claim sets back
    the fork server only, which rests again only once that build is done. The daemon's own
    process is never set, whatever pid a part reports; where they could not be taken back they
    are not set."""
    import os
    import subprocess
    import sys

    from supervisor import standby_sched

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    procs: dict[str, subprocess.Popen] = {}
    at_claim: list[dict[int, int]] = []  # every thread's policy as the build got the standby
    restore = standby_sched.restore

    def restored(pids):
        refused = restore(pids)
        at_claim.append({tid: os.sched_getscheduler(tid) for p in pids for tid in standby_sched.threads(p)})
        return refused

    monkeypatch.setattr(standby_sched, "restore", restored)

    def policies(pid):
        return {os.sched_getscheduler(tid) for tid in standby_sched.threads(pid)}

    def process(key):
        if key not in procs:
            procs[key] = subprocess.Popen(sleeper)
        return procs[key]

    async def started(pid_of):
        """A fake daemon whose standby's parts run on this host as the pids ``pid_of`` names."""
        sup = FakeSupervisor(settings(tmp_path))
        host = sup.builder.standby_workers
        fake_states = host.states
        host.states = lambda workers: [dict(s, pid=pid_of(w["actor_id"]), local=True)
                                       for w, s in zip(workers, fake_states(workers))]
        host.forkserver_pid = lambda: pid_of("forkserver")
        return sup, asyncio.create_task(sup.run())

    async def stopped(owner):
        owner.cancel()
        await asyncio.gather(owner, return_exceptions=True)

    async def scenario():
        sup, owner = await started(lambda key: process(key).pid)
        b = sup.builder
        await wait_for(lambda: sup.standby.state is StandbyState.READY and sup.standby.resting, 10)
        worker, server = procs[b.standby_made[0]["actor_id"]].pid, procs["forkserver"].pid
        assert sup.standby.resting == sorted([worker, server]) == sup.status()["standby"]["resting"]
        assert policies(worker) == policies(server) == {os.SCHED_IDLE}
        # a build of another number (one placed while another adopts) forks from the fork
        # server only: that comes back, the worker rests on for the build it is kept for
        other = sup.standby.generation + 7
        assert (await sup.standby.claim(other))["namespace"] is None
        assert policies(server) == {os.SCHED_OTHER} and policies(worker) == {os.SCHED_IDLE}
        assert sup.standby.resting == [worker] and sup.standby.state is StandbyState.READY

        sup.engines[0].die()
        sup.post(EngineFailed(1, "worker_death", "rank 0 killed"))
        await wait_for(lambda: sup.recoveries and sup.standby.state is StandbyState.READY and sup.standby.generation == 3, 10)
        assert b.serving[2] == b.standby_made[0]["actor_id"]  # the build adopted the standby's worker
        # the cold first build's claim had nothing resting; the other build's took the fork server
        claimed = [c for c in at_claim if c]
        assert len(claimed) == 2 and set(claimed[1]) == set(standby_sched.threads(worker)), at_claim
        assert set(claimed[1].values()) == {os.SCHED_OTHER}, at_claim  # the worker set back before the build
        assert policies(worker) == {os.SCHED_OTHER}  # and it serves at the normal policy
        # the next standby: a new worker resting; the fork server not, while the other build may
        # still fork from it
        nxt = procs[b.standby_made[1]["actor_id"]].pid
        assert sup.standby.resting == [nxt] and policies(nxt) == {os.SCHED_IDLE}
        assert policies(server) == {os.SCHED_OTHER}
        sup.standby.build_failed(other)  # that build is done: the next ready standby rests it all
        sup.engines[-1].die()
        sup.post(EngineFailed(2, "worker_death", "rank 0 killed"))
        await wait_for(lambda: len(sup.recoveries) == 2 and sup.standby.state is StandbyState.READY
                       and sup.standby.generation == 4, 10)
        last = procs[b.standby_made[2]["actor_id"]].pid
        assert sup.standby.resting == sorted([last, server]) and policies(server) == {os.SCHED_IDLE}
        await stopped(owner)

        # a fake whose parts report the test's own pid (as the pidfd test above): never set
        sup, owner = await started(lambda key: os.getpid())
        await wait_for(lambda: sup.standby.state is StandbyState.READY, 10)
        assert sup.standby.resting == [] and os.sched_getscheduler(0) == os.SCHED_OTHER
        await stopped(owner)

        # a daemon that could not take them back leaves them at the normal policy
        monkeypatch.setattr(standby_sched, "can_rest", lambda pid, privileged: False)
        sup, owner = await started(lambda key: process(f"unrestable-{key}").pid)
        await wait_for(lambda: sup.standby.state is StandbyState.READY, 10)
        unrestable = [p.pid for key, p in procs.items() if key.startswith("unrestable-")]
        assert sup.standby.resting == [] and len(unrestable) == 2
        assert all(policies(pid) == {os.SCHED_OTHER} for pid in unrestable)
        await stopped(owner)

    run_killing(scenario(), procs)


def test_a_ready_standbys_workers_are_stopped_and_continued_before_a_build_or_a_kill_takes_them(tmp_path, monkeypatch):
    """Once ready, the standby's workers on this host are stopped (SIGSTOP,
    ``supervisor.standby_sched.stop``); the fork server is not. Another build's claim leaves the
    worker stopped; the claim of the build it is kept for continues it before that build adopts
    it, and the next ready standby's worker is stopped in its turn. A discard continues it before
    the kill (Ray's kill of a stopped actor falls back to SIGKILL after 5 s). A bench that leaves
    ``freeze`` out finds it running."""
    import subprocess
    import sys

    from executor import procfs

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    procs: dict[str, subprocess.Popen] = {}

    def state(pid):  # "T" stopped, "-" not (running or asleep)
        return "T" if procfs.stat(pid)[0] == b"T" else "-"

    def process(key):
        if key not in procs:
            procs[key] = subprocess.Popen(sleeper)
        return procs[key]

    async def started():
        sup = FakeSupervisor(settings(tmp_path))
        host = sup.builder.standby_workers
        fake_states = host.states
        host.states = lambda workers: [dict(s, pid=process(w["actor_id"]).pid, local=True)
                                       for w, s in zip(workers, fake_states(workers))]
        host.forkserver_pid = lambda: process("forkserver").pid
        seen: list[tuple[str, str]] = []  # (what took the standby's workers, their state then)
        build, kill = sup.builder.build, host.kill

        def building(number, standby=None, replica=0, start_workers=None):
            if standby and standby.get("namespace"):
                seen.append(("build", "".join(state(w["pid"]) for w in sup.standby.workers)))
            return build(number, standby, replica, start_workers)

        def killing(workers):
            seen.append(("kill", "".join(state(process(w["actor_id"]).pid) for w in workers)))
            kill(workers)

        sup.builder.build, host.kill = building, killing
        return sup, asyncio.create_task(sup.run()), seen

    async def stopped(owner):
        owner.cancel()
        await asyncio.gather(owner, return_exceptions=True)

    async def scenario():
        sup, owner, seen = await started()
        b = sup.builder
        await wait_for(lambda: sup.standby.state is StandbyState.READY and sup.standby.stopped, 10)
        worker, server = procs[b.standby_made[0]["actor_id"]].pid, procs["forkserver"].pid
        assert sup.standby.stopped == [worker] == sup.status()["standby"]["stopped"]
        await wait_for(lambda: state(worker) == "T", 5)  # SIGSTOP takes effect once the kernel runs it
        assert (state(worker), state(server)) == ("T", "-")
        # another build's claim forks from the fork server only: the worker stays stopped
        assert (await sup.standby.claim(sup.standby.generation + 7))["namespace"] is None
        assert state(worker) == "T" and sup.standby.stopped == [worker]
        sup.standby.build_failed(sup.standby.generation + 7)

        sup.engines[0].die()
        sup.post(EngineFailed(1, "worker_death", "rank 0 killed"))
        await wait_for(lambda: sup.recoveries and sup.standby.state is StandbyState.READY and sup.standby.generation == 3, 10)
        assert b.serving[2] == b.standby_made[0]["actor_id"]  # the build adopted the standby's worker
        assert seen == [("build", "-")], seen  # running when the build took it
        assert state(worker) == "-"  # and it serves running
        nxt = procs[b.standby_made[1]["actor_id"]].pid
        assert sup.standby.stopped == [nxt] and state(nxt) == "T"
        # a discard continues it before the kill
        await sup.standby.discard("the engine arguments changed")
        assert seen[1:] == [("kill", "-")] and sup.standby.stopped == [], seen
        await stopped(owner)

        # left out by a bench: the worker waits running
        monkeypatch.setenv("VLLM_SUPERVISOR_TEST_HOOKS", "1")
        monkeypatch.setenv("VLLM_SUPERVISOR_TEST_STANDBY_WITHOUT", "freeze")
        procs.clear()
        sup, owner, _ = await started()
        await wait_for(lambda: sup.standby.state is StandbyState.READY, 10)
        assert sup.standby.stopped == [] and state(procs[sup.builder.standby_made[0]["actor_id"]].pid) == "-"
        await stopped(owner)

    run_killing(scenario(), procs)
