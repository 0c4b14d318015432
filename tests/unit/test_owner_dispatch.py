"""The owner's dispatch fed events, without an event loop: every transition of a recovery, a
budget spent, a build that failed or is unwanted, the cluster's loss, a planned rebuild and the
stop, asserted on the daemon's and the replicas' states and on the work the owner starts.

The work is recorded, not run: ``spawn`` receives what ``Recovery``'s methods would return (a
tuple naming the call here), and ``later`` the events the owner asks to be posted later."""

from __future__ import annotations

import asyncio
import signal
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from config import load_settings
from config.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_RAY_LOST
from supervisor.events import (
    BuildFinished, ClusterBack, ClusterLost, ControlCommand, Drained, EngineFailed, Placed, Prepared, RetryDue,
    SignalReceived, StopDeadline, StopFinished, TeardownBegan, TeardownFinished,
)
from supervisor.generation import Generation
from supervisor.owner import Owner, Parts
from supervisor.states import ReplicaState as R, State


class Work:
    """``supervisor.recovery.Recovery`` as the owner calls it: each call returns its name and arguments."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: (name, *args, *kwargs.values())


class FakeStandby:
    enabled = False

    def reserved(self):
        return None

    def take(self, number):
        pass

    def prepare(self, number, vllm_config, replica):
        return False


class Future:
    def __init__(self):
        self.result = None

    def done(self):
        return self.result is not None

    def set_result(self, value):
        self.result = value


def make(replicas=1, **supervisor):
    base = {"replicas": replicas, "max_restarts": 2, "restart_window_s": 600, "restart_backoff_initial_s": 0,
            **supervisor}
    settings = load_settings(None, {f"supervisor.{k}": v for k, v in base.items()}, environ={})
    spawned, later = [], []
    ray = SimpleNamespace(cluster_lost=False, cluster=object(), released=False, agent_pid=None,
                          settings=SimpleNamespace(reconnect_timeout_s=60))

    def mark_lost():
        ray.cluster_lost = True

    ray.mark_lost = mark_lost
    parts = Parts(work=Work(), cluster=Work(), standby=FakeStandby(), ray=ray,
                  builder=SimpleNamespace(config_epoch=0, world_size=1),
                  client=SimpleNamespace(epoch=0, in_flight=0, holds_now=lambda: (None, None)),
                  metrics=MagicMock(), notifier=MagicMock(), quarantine=MagicMock(),
                  spawn=spawned.append, later=lambda delay, event: later.append(event))
    owner = Owner(settings, SimpleNamespace(api_key=None), parts)
    return owner, spawned, later


def gen(number, replica=0):
    return Generation(number, f"g{number}", SimpleNamespace(vllm_config=None), set(), 0.1, replica=replica)


def started(replicas=1, **supervisor):
    """A READY owner: every replica's first build placed and up (generations 1..n)."""
    owner, spawned, later = make(replicas, **supervisor)
    owner.dispatch(Prepared())
    for i in range(replicas):
        owner.dispatch(Placed(i))
    for i in range(replicas):
        owner.dispatch(BuildFinished(i, i + 1, gen(i + 1, i)))
    spawned.clear()
    return owner, spawned, later


def states(owner):
    return [r.state for r in owner.replicas]


def test_first_start():
    owner, spawned, _ = make(replicas=2)
    assert owner.state is State.STARTING and states(owner) == [R.NEW, R.NEW]
    owner.dispatch(Prepared())
    assert states(owner) == [R.PLACING, R.PLACING] and spawned == [("place", 0, 0.0), ("place", 1, 0.0)]
    owner.dispatch(Placed(1))
    assert states(owner) == [R.PLACING, R.BUILDING] and owner.replicas[1].building == 1
    assert spawned[-1] == ("build", 1, 1, False, False)  # number 1, no reattach; a first build adopts no standby
    owner.dispatch(BuildFinished(1, 1, gen(1, 1)))
    assert owner.state is State.READY and states(owner) == [R.PLACING, R.SERVING]
    assert owner.snapshot.state is State.READY and owner.snapshot.replicas[1].serving()
    assert owner.changed.is_set()


def test_a_first_start_that_cannot_prepare_fails_with_3():
    owner, spawned, _ = make()
    owner.dispatch(Prepared("could not start: no model"))
    assert owner.state is State.STOPPING and owner.exit_code == EXIT_FAILED
    assert states(owner) == [R.STOPPED] and spawned == [("abandon_builds",), ("finish_stop",)]
    owner.dispatch(StopFinished())
    assert owner.state is State.FAILED and "no model" in owner.machine.reason


def test_one_worker_death_as_events():
    owner, spawned, _ = started()
    old = owner.replicas[0].current
    owner.dispatch(EngineFailed(1, "worker_death", "rank 0 killed"))
    assert owner.state is State.RECOVERING and states(owner) == [R.TEARING_DOWN] and old.failed
    assert spawned == [("teardown", 0, old, False)]
    assert not owner.snapshot.replicas[0].serving()
    owner.dispatch(TeardownBegan(0, 1, 0.0))
    assert owner.replicas[0].record.teardown_monotonic == 0.0
    owner.dispatch(TeardownFinished(0, 1, phases={"teardown": 0.2}))
    assert states(owner) == [R.PLACING] and owner.replicas[0].current is None and spawned[-1] == ("place", 0, 0.0)
    owner.dispatch(Placed(0, phases={"placement_group": 0.01}))
    assert states(owner) == [R.BUILDING] and spawned[-1][:3] == ("build", 0, 2)
    owner.dispatch(BuildFinished(0, 2, gen(2)))
    assert owner.state is State.READY and states(owner) == [R.SERVING] and owner.snapshot.generation == 2
    (record,) = owner.records
    assert record["reason"] == "worker_death" and record["ok"] and record["to_generation"] == 2
    assert set(record["phases_s"]) >= {"detect", "teardown", "placement_group"}
    assert owner.restarts == {"worker_death": 1}


def test_repeats_and_retired_generations_are_ignored():
    owner, spawned, _ = started()
    owner.dispatch(EngineFailed(1, "engine_dead", "x"))
    owner.dispatch(EngineFailed(1, "engine_dead", "again"))
    owner.dispatch(EngineFailed(7, "engine_dead", "never existed"))
    assert len(spawned) == 1 and states(owner) == [R.TEARING_DOWN]


def test_a_worker_death_report_that_lost_the_race_refines_the_cause():
    owner, _, _ = started()
    owner.dispatch(EngineFailed(1, "engine_dead", "EngineDeadError", detected_monotonic=1.0))
    owner.dispatch(EngineFailed(1, "worker_death", "rank 0: killed by ray.kill", detected_monotonic=1.1))
    assert owner.replicas[0].record.reason == "worker_death"


def test_a_generation_that_fails_while_built_is_dropped():
    owner, spawned, _ = started()
    owner.dispatch(EngineFailed(1, "engine_dead", "x"))
    owner.dispatch(TeardownFinished(0, 1))
    owner.dispatch(Placed(0))
    owner.dispatch(EngineFailed(2, "engine_dead", "its engine core died while starting"))
    new = gen(2)
    owner.dispatch(BuildFinished(0, 2, new))  # nobody wants it any more
    assert states(owner) == [R.TEARING_DOWN] and spawned[-1] == ("teardown", 0, new, False) and owner.state is State.RECOVERING
    owner.dispatch(TeardownFinished(0, 2))
    assert states(owner) == [R.PLACING] and owner.restarts["build_failed"] == 1


def test_a_failed_build_is_retried_until_the_budget_is_spent_then_one_replica_fails_with_3():
    owner, spawned, _ = started(max_restarts=2)
    owner.dispatch(EngineFailed(1, "engine_dead", "x"))
    owner.dispatch(TeardownFinished(0, 1))  # restart 1 of 2
    owner.dispatch(Placed(0))
    owner.dispatch(BuildFinished(0, 2, error="RuntimeError: boom"))
    assert states(owner) == [R.PLACING] and owner.replicas[0].last_error == "RuntimeError: boom"  # restart 2 of 2
    assert spawned[-1][0] == "place"
    owner.dispatch(Placed(0))
    owner.dispatch(BuildFinished(0, 3, error="RuntimeError: boom"))  # a third: over the budget
    assert owner.state is State.STOPPING and owner.exit_code == EXIT_FAILED and states(owner) == [R.STOPPED]
    assert "restart intensity exceeded" in owner.machine.reason
    assert owner.records[-1]["ok"] is False
    owner.dispatch(StopFinished())
    assert owner.state is State.FAILED


def test_placement_that_waits_for_capacity_says_so():
    owner, _, _ = started(max_restarts=5)
    owner.dispatch(EngineFailed(1, "engine_dead", "x"))
    owner.dispatch(TeardownFinished(0, 1))
    owner.dispatch(Placed(0, "PlacementGroupTimeout: no room", capacity=True))
    assert owner.state is State.RECOVERING and owner.machine.reason.startswith("waiting for capacity")
    assert states(owner) == [R.PLACING]


def test_with_two_replicas_a_spent_budget_waits_while_the_other_serves():
    owner, spawned, later = started(replicas=2, max_restarts=1)
    owner.dispatch(EngineFailed(2, "engine_dead", "x"))
    assert owner.state is State.READY and states(owner) == [R.SERVING, R.TEARING_DOWN]
    owner.dispatch(TeardownFinished(1, 2))  # its one restart
    owner.dispatch(Placed(1))
    owner.dispatch(BuildFinished(1, 3, error="RuntimeError: boom"))  # spent
    assert states(owner) == [R.SERVING, R.WAITING] and owner.state is State.READY
    assert owner.replicas[1].retry_at is not None and later == [RetryDue(1)]
    assert owner.snapshot.replicas[1].word == "waiting"
    owner.replicas[1].intensity._times.clear()  # the window passed
    owner.dispatch(RetryDue(1))
    assert states(owner) == [R.SERVING, R.PLACING] and owner.replicas[1].retry_at is None


def test_a_replica_waiting_alone_fails_the_daemon():
    owner, _, _ = started(replicas=2, max_restarts=1)
    owner.dispatch(EngineFailed(2, "engine_dead", "x"))
    owner.dispatch(TeardownFinished(1, 2))
    owner.dispatch(Placed(1))
    owner.dispatch(BuildFinished(1, 3, error="RuntimeError: boom"))
    assert states(owner)[1] is R.WAITING
    owner.dispatch(EngineFailed(1, "engine_dead", "the other one too"))
    # replica 0 is on its way up (tearing down): replica 1 may wait for it
    assert owner.state is State.RECOVERING and states(owner) == [R.TEARING_DOWN, R.WAITING]
    owner.dispatch(TeardownFinished(0, 1))
    owner.dispatch(Placed(0))
    owner.dispatch(BuildFinished(0, 4, error="RuntimeError: boom"))  # replica 0's budget spent too
    assert owner.state is State.STOPPING and owner.exit_code == EXIT_FAILED
    assert "no other replica serves" in owner.machine.reason


def test_cluster_loss_fails_what_serves_dooms_what_builds_and_waits_for_it():
    owner, spawned, _ = started(replicas=2)
    owner.dispatch(EngineFailed(2, "engine_dead", "x"))
    owner.dispatch(TeardownFinished(1, 2))
    owner.dispatch(Placed(1))  # replica 1 builds generation 3
    spawned.clear()
    owner.dispatch(ClusterLost("127.0.0.1:6379", "the Ray agent died", 5.0))
    assert owner.p.ray.cluster_lost and spawned[0] == ("lose", 5.0) and 3 in owner.doomed
    assert owner.state is State.RECOVERING and states(owner) == [R.TEARING_DOWN, R.BUILDING]
    assert owner.replicas[0].record.reason == "ray_lost"
    owner.dispatch(ClusterLost("127.0.0.1:6379", "again", 6.0))  # a repeat
    assert len(spawned) == 2
    owner.dispatch(ClusterBack(3.0))
    assert "ray cluster back after 3.0 s" in owner.machine.reason


def test_the_cluster_not_back_in_time_exits_75():
    owner, _, _ = started()
    owner.dispatch(ClusterLost("127.0.0.1:6379", "gone", 1.0))
    owner.dispatch(TeardownFinished(0, 1))
    owner.dispatch(Placed(0, "ray cluster at 127.0.0.1:6379 lost and not back within 60 s", fatal=True))
    assert owner.state is State.STOPPING and owner.exit_code == EXIT_RAY_LOST and states(owner) == [R.STOPPED]


def test_an_operator_restart_of_two_replicas_goes_one_after_the_other():
    owner, spawned, _ = started(replicas=2)
    reply = Future()
    owner.dispatch(ControlCommand("restart", {}, reply))
    assert reply.result["ok"] and owner.state is State.READY  # several replicas: no drain
    assert states(owner) == [R.TEARING_DOWN, R.SERVING] and owner.replicas[0].record.first.reason == "operator"
    assert owner.busy()
    refused = Future()
    owner.dispatch(ControlCommand("restart", {}, refused))
    assert not refused.result["ok"]
    owner.dispatch(TeardownFinished(0, 1))
    owner.dispatch(Placed(0))
    assert states(owner) == [R.BUILDING, R.SERVING]  # replica 1 waits for replica 0
    owner.dispatch(BuildFinished(0, 3, gen(3)))
    assert states(owner) == [R.SERVING, R.TEARING_DOWN]
    owner.dispatch(TeardownFinished(1, 2))
    owner.dispatch(Placed(1))
    owner.dispatch(BuildFinished(1, 4, gen(4, 1)))
    assert states(owner) == [R.SERVING, R.SERVING] and owner.plan is None and not owner.busy()
    assert owner.restarts == {"operator": 2}


def test_one_replica_restarts_behind_a_drain():
    owner, spawned, _ = started()
    reply = Future()
    owner.dispatch(ControlCommand("restart", {}, reply))
    assert owner.state is State.DRAINING and spawned == [("drain", "rebuild", owner.cfg.drain_timeout_s)]
    assert states(owner) == [R.SERVING]
    owner.dispatch(Drained("rebuild"))
    assert states(owner) == [R.TEARING_DOWN] and owner.state is State.RECOVERING
    owner.dispatch(TeardownFinished(0, 1))
    owner.dispatch(Placed(0))
    owner.dispatch(BuildFinished(0, 2, gen(2)))
    assert owner.state is State.READY and owner.plan is None


def test_drain_and_resume():
    owner, _, _ = started()
    for cmd, ok, state in [("resume", False, State.READY), ("drain", True, State.DRAINING),
                           ("drain", False, State.DRAINING), ("resume", True, State.READY)]:
        reply = Future()
        owner.dispatch(ControlCommand(cmd, {}, reply))
        assert reply.result["ok"] is ok and owner.state is state


def test_kill_worker_is_work_with_its_reply():
    owner, spawned, _ = started()
    reply = Future()
    owner.dispatch(ControlCommand("kill-worker", {"rank": 0}, reply))
    assert reply.result is None and asyncio.iscoroutine(spawned[-1])  # answered by the task
    spawned[-1].close()
    for args, error in [({"rank": 3}, "out of range"), ({"rank": 0, "replica": 2}, "out of range")]:
        reply = Future()
        owner.dispatch(ControlCommand("kill-worker", args, reply))
        assert error in reply.result["error"]


def test_the_stop_drains_waits_for_work_under_way_then_tears_down():
    owner, spawned, later = started(replicas=2)
    owner.p.client.in_flight = 3
    owner.dispatch(EngineFailed(2, "engine_dead", "x"))  # replica 1 tearing down
    spawned.clear()
    owner.dispatch(SignalReceived(signal.SIGTERM))
    assert owner.state is State.STOPPING and spawned == [("abandon_builds",), ("drain", "stop", owner.cfg.drain_timeout_s)]
    owner.dispatch(SignalReceived(signal.SIGTERM))  # already stopping
    owner.dispatch(Drained("stop"))
    assert later == [StopDeadline()]
    assert states(owner) == [R.STOPPED, R.TEARING_DOWN] and spawned[-1][0] == "teardown"  # replica 0's engine
    owner.dispatch(TeardownFinished(0, 1))
    assert spawned[-1][0] == "teardown"  # not finishing yet: replica 1's recovery is tearing down
    owner.dispatch(TeardownFinished(1, 2))
    assert states(owner) == [R.STOPPED, R.STOPPED] and spawned[-1] == ("finish_stop",)
    owner.dispatch(StopFinished())
    assert owner.state is State.STOPPED and owner.exit_code == EXIT_OK


def test_the_stop_stops_waiting_at_its_deadline():
    owner, spawned, _ = started()
    owner.dispatch(EngineFailed(1, "engine_dead", "x"))
    owner.dispatch(TeardownFinished(0, 1))
    owner.dispatch(Placed(0))  # building, for a long time
    owner.dispatch(SignalReceived(signal.SIGTERM))
    assert states(owner) == [R.BUILDING]
    owner.dispatch(StopDeadline())
    assert states(owner) == [R.STOPPED] and spawned[-1] == ("finish_stop",)
    late = gen(2)
    owner.dispatch(BuildFinished(0, 2, late))  # nobody waits for it: only its engine goes
    assert spawned[-1] == ("teardown", 0, late, False) and states(owner) == [R.STOPPED]


def test_the_stop_cuts_a_build_short_and_counts_no_restart():
    """A build under way when the stop begins is abandoned (its engine core killed: the build
    fails at once), not waited for until the deadline; its failure is the stop's, not a restart."""
    owner, spawned, _ = started()
    owner.dispatch(EngineFailed(1, "engine_dead", "x"))
    owner.dispatch(TeardownFinished(0, 1))
    owner.dispatch(Placed(0))  # building, for a long time
    restarts = dict(owner.restarts)
    spawned.clear()
    owner.dispatch(SignalReceived(signal.SIGTERM))
    assert spawned[0] == ("abandon_builds",) and states(owner) == [R.BUILDING]
    owner.dispatch(BuildFinished(0, 2, error="RuntimeError: Engine core initialization failed"))
    assert states(owner) == [R.STOPPED] and spawned[-1] == ("finish_stop",)
    assert owner.restarts == restarts


@pytest.mark.parametrize("event", [Placed(0), BuildFinished(0, 9, error="x"), TeardownFinished(0, 9), RetryDue(0)])
def test_results_for_a_replica_in_another_state_are_dropped(event):
    owner, spawned, _ = started()
    owner.dispatch(event)
    assert states(owner) == [R.SERVING] and owner.state is State.READY and spawned == []
