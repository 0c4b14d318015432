"""The lifecycle transition table: every legal move works, every other raises."""

import itertools

import pytest

from supervisor.states import TRANSITIONS, IllegalTransition, State, StateMachine


def test_table_covers_every_state():
    assert set(TRANSITIONS) == set(State)


def test_terminal_states_have_no_way_out():
    for state in State:
        assert (not TRANSITIONS[state]) == state.terminal


def test_happy_path_and_hooks():
    seen = []
    m = StateMachine(on_transition=[lambda a, b, r: seen.append((a, b, r))])
    m.transition(State.READY, "engine up")
    m.transition(State.STOPPING, "SIGTERM")
    m.transition(State.STOPPED, "done")
    assert [b for _, b, _ in seen] == [State.READY, State.STOPPING, State.STOPPED]
    assert m.reason == "done"


@pytest.mark.parametrize("src, dst", list(itertools.product(State, State)))
def test_every_pair(src, dst):
    m = StateMachine(state=src)
    if dst in TRANSITIONS[src]:
        m.transition(dst, "ok")
        assert m.state is dst
    else:
        with pytest.raises(IllegalTransition):
            m.transition(dst, "not allowed")
        assert m.state is src


def test_illegal_examples():
    for src, dst in [(State.STOPPED, State.READY), (State.FAILED, State.STARTING), (State.STARTING, State.DRAINING), (State.STOPPING, State.READY)]:
        assert dst not in TRANSITIONS[src]


# --- a replica's machine -----------------------------------------------------------------------

from supervisor.states import REPLICA_TRANSITIONS, ReplicaState, replica_machine  # noqa: E402


def test_replica_table_covers_every_state_and_only_stopped_is_terminal():
    assert set(REPLICA_TRANSITIONS) == set(ReplicaState)
    assert [s for s in ReplicaState if not REPLICA_TRANSITIONS[s]] == [ReplicaState.STOPPED]
    assert all(ReplicaState.STOPPED in REPLICA_TRANSITIONS[s] for s in ReplicaState if s is not ReplicaState.STOPPED)


@pytest.mark.parametrize("src, dst", list(itertools.product(ReplicaState, ReplicaState)))
def test_every_replica_pair(src, dst):
    m = replica_machine()
    m.state = src
    if dst in REPLICA_TRANSITIONS[src]:
        m.transition(dst, "ok")
        assert m.state is dst and m.reason == "ok"
    else:
        with pytest.raises(IllegalTransition):
            m.transition(dst, "not allowed")
        assert m.state is src


def test_a_recovery_is_a_path_through_the_replica_table():
    m = replica_machine()
    for to in ["placing", "building", "serving", "tearing_down", "placing", "building", "placing", "waiting",
               "placing", "building", "tearing_down", "placing", "building", "serving", "stopped"]:
        m.transition(ReplicaState(to), to)
    assert m.state is ReplicaState.STOPPED
