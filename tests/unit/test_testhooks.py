"""The test hooks' request keys (``supervisor.testhooks``): where a request holds, and on how
many of its engines."""

from types import SimpleNamespace

from supervisor import testhooks


def params(**extra):
    return SimpleNamespace(extra_args=extra or None)


def test_a_request_without_a_hold_key_never_holds():
    assert testhooks.hold_point(params()) is None
    assert testhooks.hold_point(params(other=3)) is None


def test_midchar_holds_mid_character_after_holds_at_once():
    assert testhooks.hold_point(params(supervisor_test_hold_midchar=8)) == (8, True)
    assert testhooks.hold_point(params(supervisor_test_hold_after="6")) == (6, False)


def test_a_request_holds_on_its_first_engine_unless_it_names_more():
    assert testhooks.hold_engines(params(supervisor_test_hold_midchar=8)) == 1
    assert testhooks.hold_engines(params(supervisor_test_hold_midchar=8, supervisor_test_hold_engines=3)) == 3
    assert testhooks.hold_engines(params(supervisor_test_hold_engines="x")) == 1
