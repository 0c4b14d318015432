"""Unit tests of logic run the warm standby without its settle after READY
(``supervisor.standby.SETTLE_S``, 3 s): ``test_standby_fake`` sets its own to prove the settle."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_standby_settle(monkeypatch):
    monkeypatch.setattr("supervisor.standby.SETTLE_S", 0.0)
