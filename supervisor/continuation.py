"""Continuing a request on a new engine: prompt + delivered tokens, the remaining budget,
the same sampling parameters. Pure logic over vLLM's ``SamplingParams``."""

from __future__ import annotations

import copy
from typing import Any


class NotContinuable(Exception):
    """The request cannot be continued exactly; the client should retry it."""


def why_not_continuable(params: Any) -> str | None:
    """The reason a request with ``params`` cannot be continued token-exactly, or None."""
    if getattr(params, "n", 1) != 1:
        return "n > 1"
    if getattr(params, "structured_outputs", None) is not None:
        return "guided decoding (structured outputs) keeps state the new engine cannot rebuild"
    if (params.presence_penalty or 0) != 0 or (params.frequency_penalty or 0) != 0:
        return "presence/frequency penalties count only generated tokens"
    if getattr(params, "seed", None) is not None and (params.temperature or 0) > 0:
        return "seeded sampling cannot resume its random stream"
    if params.stop:
        return "stop strings may straddle the resume point"
    return None


def continuation_params(params: Any, delivered: int) -> Any:
    """``params`` for the rest of a request after ``delivered`` tokens reached the client."""
    if delivered == 0:
        return copy.deepcopy(params)  # the engine may have mutated the one it was given
    reason = why_not_continuable(params)
    if reason:
        raise NotContinuable(reason)
    remaining = params.max_tokens - delivered
    if remaining < 1:
        raise NotContinuable("no token budget left")
    sub = copy.deepcopy(params)
    sub.max_tokens = remaining
    sub.min_tokens = max(0, (params.min_tokens or 0) - delivered)
    return sub
