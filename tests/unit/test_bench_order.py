"""bench.serving_overhead.alternating: the order its rounds measure the servers in (logic only)."""

from __future__ import annotations

from collections import Counter
from itertools import groupby

from bench.serving_overhead import alternating


def orders(kinds: list[str], rounds: int) -> list[list[str]]:
    return [[k for _, k in group] for _, group in groupby(alternating(kinds, rounds), key=lambda rk: rk[0])]


def test_two_kinds_are_reversed_every_other_round():
    assert orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]


def test_three_kinds_each_take_each_place_and_follow_each_other_alike():
    got = orders(["a", "b", "c"], 6)
    assert got[0] == ["a", "b", "c"]  # the order asked for comes first
    places = Counter((k, i) for order in got for i, k in enumerate(order))
    assert set(places.values()) == {2} and len(places) == 9  # each kind twice in each place
    follows = Counter((x, y) for order in got for x, y in zip(order, order[1:]))
    assert set(follows.values()) == {2} and len(follows) == 6  # each kind after each other one twice
    assert orders(["a", "b", "c"], 12)[6:] == got  # and again
