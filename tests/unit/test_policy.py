"""Restart intensity and backoff: pure logic."""

import random

from supervisor.policy import RestartIntensity, backoff_s


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_restart_budget_within_window():
    clock = Clock()
    r = RestartIntensity(max_restarts=2, window_s=60, clock=clock)
    assert r.record() and r.record()
    assert not r.record()  # third restart within 60 s exceeds the budget


def test_old_restarts_leave_the_window():
    clock = Clock()
    r = RestartIntensity(max_restarts=1, window_s=60, clock=clock)
    assert r.record()
    clock.t += 61
    assert r.record()
    assert r.recent == 1


def test_a_refused_restart_is_not_counted_and_free_in_says_when_one_fits():
    clock = Clock()
    r = RestartIntensity(max_restarts=2, window_s=60, clock=clock)
    assert r.free_in() == 0.0
    assert r.record()
    clock.t += 10
    assert r.record()
    clock.t += 5
    assert not r.record() and not r.record() and r.recent == 2  # refusals leave the budget as it was
    assert 45.0 < r.free_in() < 45.1  # the first restart leaves the window 60 s after it
    clock.t += r.free_in()
    assert r.record() and not r.record()


def test_zero_budget_fails_first_restart():
    assert not RestartIntensity(max_restarts=0, window_s=10).record()


def test_backoff_grows_with_jitter_and_caps():
    rng = random.Random(1)
    assert backoff_s(0, 0.5, 10, rng) == 0.0
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (6, 10.0), (30, 10.0)]:
        for _ in range(20):
            delay = backoff_s(attempt, 0.5, 10, rng)
            assert ceiling / 2 <= delay <= ceiling
