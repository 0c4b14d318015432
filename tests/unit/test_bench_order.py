"""bench.serving_overhead.alternating: the order its rounds measure the servers in (logic only)."""

from __future__ import annotations

from collections import Counter
from itertools import groupby

import pytest

from bench.serving_overhead import alternating


def orders(kinds: list[str], rounds: int) -> list[list[str]]:
    return [[k for _, k in group] for _, group in groupby(alternating(kinds, rounds), key=lambda rk: rk[0])]


def test_two_kinds_are_reversed_every_other_round():
    assert orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]


def test_three_kinds_turn_and_reverse():
    assert orders(["a", "b", "c"], 6) == [list(o) for o in ("abc", "cba", "bca", "acb", "cab", "bac")]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_each_kind_takes_each_place_and_follows_each_other_kind_alike(n):
    kinds = [chr(ord("a") + i) for i in range(n)]
    block = n if n % 2 == 0 else 2 * n
    got = orders(kinds, 2 * block)
    assert got[0] == kinds  # the order asked for comes first
    assert all(sorted(o) == kinds for o in got)
    places = Counter((k, i) for order in got for i, k in enumerate(order))
    assert len(places) == n * n and len(set(places.values())) == 1  # each kind equally often in each place
    follows = Counter((x, y) for order in got for x, y in zip(order, order[1:]))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1  # each after each other one alike
    assert got[block:] == got[:block]  # and again
