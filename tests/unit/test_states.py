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
