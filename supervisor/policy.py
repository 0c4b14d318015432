"""Restart intensity (as in Erlang/OTP) and retry backoff. Pure logic, no I/O."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class RestartIntensity:
    """More than ``max_restarts`` restarts within ``window_s`` means: give up (FAILED)."""

    max_restarts: int
    window_s: float
    clock: Callable[[], float] = time.monotonic
    _times: deque[float] = field(default_factory=deque)

    def record(self) -> bool:
        """Count one restart now; False (and nothing counted) when the budget is exhausted."""
        now = self._prune()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def forgive(self, n: int) -> None:
        """Take back the newest ``n`` restarts: the recoveries of a crash loop that a quarantine
        ended count as one (``supervisor.suspects``); failures without a culprit all count."""
        for _ in range(min(n, len(self._times))):
            self._times.pop()

    def free_in(self) -> float:
        """Seconds until one more restart fits in the budget (0: now)."""
        now = self._prune()
        excess = len(self._times) - self.max_restarts
        if excess < 0:
            return 0.0
        return max(0.0, self._times[excess] + self.window_s - now) + 0.001

    def _prune(self) -> float:
        now = self.clock()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return now

    @property
    def recent(self) -> int:
        now = self.clock()
        return sum(1 for t in self._times if now - t <= self.window_s)


def backoff_s(attempt: int, initial_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """The wait before build attempt ``attempt`` (0: the first, no wait): exponential backoff
    with "equal jitter", uniform in [c/2, c] where c = min(max_s, initial_s * 2**(attempt - 1)),
    so the waits grow initial, 2×initial, … up to max_s and never drop to zero."""
    if attempt <= 0 or initial_s <= 0:
        return 0.0
    ceiling = min(max_s, initial_s * (2 ** (attempt - 1)))
    return (rng or random).uniform(ceiling / 2, ceiling)
