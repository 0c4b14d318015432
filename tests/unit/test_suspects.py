"""Finding a query of death (``supervisor.suspects``): which choices a failure implicates, when
one is the culprit, who may join an engine while on probation, and the quarantine."""

import pytest
from vllm import SamplingParams

from supervisor.policy import RestartIntensity
from supervisor.suspects import ESTABLISHED, PROBATION_WAIT_S, Quarantine, Record, blocking, fingerprint, may_join, verdict

OLD, NEW = ESTABLISHED + 40, 0


def test_the_new_choices_are_implicated_the_established_ones_count_nothing():
    v = verdict({"long-1": OLD, "long-2": OLD, "poison": NEW, "just-in": 1})
    assert v.implicated == {"poison", "just-in"} and not v.plain
    innocent, poison = Record(), Record()
    assert not innocent.failed(7, "long-1", v) and innocent.interruptions == 0 and not innocent.on_probation
    assert not poison.failed(7, "poison", v) and poison.interruptions == 1 and poison.implicated == [7]


def test_two_culprits_at_once_are_each_found_on_their_second_engine():
    first = verdict({"a": NEW, "b": NEW, "long": OLD})
    a, b, long = Record(), Record(), Record()
    assert not a.failed(3, "a", first) and not b.failed(3, "b", first) and not long.failed(3, "long", first)
    second = verdict({"a": NEW, "long": OLD})  # b waits on probation while a joins the next engine
    assert a.failed(4, "a", second) and a.implicated == [3, 4]
    third = verdict({"b": NEW, "long": OLD})
    assert b.failed(5, "b", third) and b.implicated == [3, 5]
    assert long.interruptions == 0  # never failed by another request's crashes


def test_a_culprit_that_finished_before_the_crash_is_not_a_suspect():
    """A finished choice is no longer listed on its generation: the verdict never sees it."""
    v = verdict({"long": OLD})  # the short poison-looking request had finished
    assert v.plain and v.implicated == set()


def test_a_failure_with_every_choice_established_is_a_plain_fault_counted_as_before():
    v = verdict({"a": OLD, "b": OLD})
    a = Record()
    for generation in (1, 2, 3):
        assert not a.failed(generation, "a", v)
    assert a.interruptions == 3 and not a.on_probation  # continuation_limit bounds it as before


def test_a_failure_with_nothing_in_flight_implicates_nobody():
    v = verdict({})
    assert v.plain and not v.implicated


def test_implicated_twice_by_the_same_generation_is_not_two_engines():
    v = verdict({"a": NEW})
    a = Record()
    assert not a.failed(9, "a", v) and not a.failed(9, "a", v) and a.implicated == [9]


def record(outputs: int, joined: int = 1, implicated: tuple = ()) -> Record:
    r = Record()
    r.outputs_here, r.joined, r.implicated = outputs, joined, list(implicated)
    return r


def test_who_waits_to_join_an_engine():
    established, new_fresh, new_continued = record(OLD), record(NEW), record(NEW, joined=2)
    on_probation, fresh, continued = record(0, 1, (3,)), record(0, 0), record(0, 1)
    # on probation: waits for every new choice
    assert blocking(on_probation, [established]) == 0
    assert blocking(on_probation, [established, new_fresh, new_continued]) == 2
    assert blocking(on_probation, [established], parked=3) == 3  # the continued ones still on their way
    # a new request: waits only for new continued choices (innocents a fresh poison would implicate)
    assert blocking(fresh, [established, new_fresh]) == 0 and blocking(fresh, [new_continued]) == 1
    # a continued innocent: joins at once
    assert blocking(continued, [new_fresh, new_continued]) == 0
    assert may_join(0, 0.0) and not may_join(1, 0.0) and may_join(1, PROBATION_WAIT_S)


def test_the_fingerprint_is_the_input_not_how_it_is_delivered():
    from vllm.sampling_params import RequestOutputKind

    streamed = SamplingParams(temperature=0, max_tokens=9, output_kind=RequestOutputKind.DELTA,
                              extra_args={"supervisor_test_hold_after": 3, "x": 1})
    whole = SamplingParams(temperature=0, max_tokens=9, output_kind=RequestOutputKind.FINAL_ONLY, extra_args={"x": 1})
    assert fingerprint([1, 2, 3], streamed) == fingerprint([1, 2, 3], whole)
    assert fingerprint([1, 2, 4], whole) != fingerprint([1, 2, 3], whole)
    assert fingerprint([1, 2, 3], SamplingParams(temperature=0, max_tokens=10)) != fingerprint([1, 2, 3], whole)
    assert len(fingerprint([1], whole)) == 16
    # the parameters count, not only the prompt and extra_args (vLLM's params are a msgspec
    # struct, whose fields ``vars()`` does not list)
    assert fingerprint([1, 2, 3], SamplingParams(temperature=0, max_tokens=9)) != \
        fingerprint([1, 2, 3], SamplingParams(temperature=0.7, max_tokens=9))
    assert fingerprint([1, 2, 3], SamplingParams(seed=1, max_tokens=9)) != fingerprint([1, 2, 3], SamplingParams(seed=2, max_tokens=9))
    assert fingerprint([1, 2, 3], SamplingParams(seed=1, max_tokens=9)) == fingerprint([1, 2, 3], SamplingParams(seed=1, max_tokens=9))


def test_the_quarantine_forgets_after_its_window_and_beyond_its_size():
    now = [0.0]
    q = Quarantine(window_s=60, size=2, clock=lambda: now[0])
    q.add("a")
    now[0] = 59
    assert "a" in q and "b" not in q
    now[0] = 61
    assert "a" not in q and len(q) == 0
    q.add("a"), q.add("b"), q.add("c")
    assert "a" not in q and "b" in q and "c" in q


@pytest.mark.parametrize("spent, forgiven, left", [(2, 1, 1), (1, 1, 0), (0, 1, 0)])
def test_a_crash_loop_ended_by_a_quarantine_counts_once(spent, forgiven, left):
    budget = RestartIntensity(max_restarts=5, window_s=600)
    for _ in range(spent):
        assert budget.record()
    budget.forgive(forgiven)
    assert budget.recent == left


def test_a_planned_rebuild_counts_for_nobody_and_a_failure_is_judged_once():
    from types import SimpleNamespace

    from supervisor.generation import Generation

    def on(planned: bool) -> Generation:
        gen = Generation(1, "g1", None, set(), 0.0, planned=planned)
        gen.choices = {"new": SimpleNamespace(suspect=record(0)), "old": SimpleNamespace(suspect=record(OLD))}
        return gen

    planned = on(True).failure_verdict()
    assert not planned.implicated and not planned.plain  # an operator's restart or reload
    gen = on(False)
    first = gen.failure_verdict()
    assert first.implicated == {"new"}
    gen.choices.clear()  # the choices leave as they see the failure: the verdict stays the first one
    assert gen.failure_verdict() is first


def test_several_on_probation_new_together_are_not_told_apart():
    """After their wait ran out, two choices on probation joined together and the engine failed:
    neither counts it as its second failure; the next one, alone, decides."""
    a, b = Record(), Record()
    first = verdict({"a": NEW, "b": NEW})
    a.failed(1, "a", first), b.failed(1, "b", first)
    together = verdict({"a": NEW, "b": NEW, "long": OLD}, on_probation=["a", "b"])
    assert not together.singles_out
    assert not a.failed(2, "a", together) and not b.failed(2, "b", together) and a.implicated == [1]
    alone = verdict({"a": NEW, "long": OLD}, on_probation=["a"])
    assert a.failed(3, "a", alone) and a.implicated == [1, 3]
