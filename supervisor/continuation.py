"""Continuing a request on a new engine: prompt + delivered tokens, the remaining budget,
the same sampling parameters, and the text across the seam. Pure logic over vLLM's
``SamplingParams`` and an incremental detokenizer handed in by the caller."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from executor.resume import RESUME_IDS_KEY


class NotContinuable(Exception):
    """The request cannot be continued exactly; the client should retry it."""


def continuation_input(prompt: Any, prompt_ids: list[int], delivered: list[int]) -> dict[str, Any]:
    """The engine input that resumes a request: its prompt tokens + the delivered tokens."""
    if isinstance(prompt, dict) and prompt.get("type", "token") != "token":
        raise NotContinuable(f"{prompt['type']} prompts are not continued")
    out: dict[str, Any] = {"type": "token", "prompt_token_ids": list(prompt_ids) + list(delivered)}
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        out["cache_salt"] = prompt["cache_salt"]
    return out


@dataclass(frozen=True)
class Engines:
    """What the serving engines do that continuing a request depends on (read from their config)."""

    reasoning: bool = False  # a --reasoning-parser: where the reasoning ended is the parser's state
    history: str | None = None  # why their workers do not carry a request's past (None: they do)
    replay: str | None = None  # why a seeded random stream is not replayed there (None: it is)


def why_not_continuable(params: Any, engines: Engines = Engines()) -> str | None:
    """The reason a request with ``params`` cannot be continued exactly on ``engines``, or None.

    A continued request's past on the failed engine is carried into the new one: the grammar
    of a structured output (``executor.resume``), the tokens penalties and ``bad_words`` count
    and a seeded random stream (``executor.history``)."""
    if getattr(params, "n", 1) != 1:
        return "n > 1"  # (Streams runs each choice of such a request as a stream of its own)
    if engines.history is not None:
        if (params.presence_penalty or 0) != 0 or (params.frequency_penalty or 0) != 0:
            return f"presence/frequency penalties: {engines.history}"
        if getattr(params, "bad_words", None):
            return f"bad_words: {engines.history}"
    if getattr(params, "seed", None) is not None and (params.temperature or 0) > 0:
        if engines.replay is not None or engines.history is not None:
            return f"seeded sampling: {engines.replay or engines.history}"
    if getattr(params, "logprobs", None) is not None and getattr(params, "flat_logprobs", False):
        return "flat logprobs are not continued"
    if engines.reasoning and getattr(params, "structured_outputs", None) is not None:
        return "structured outputs with a reasoning parser (where the reasoning ended is its state)"
    return None


def child_params(params: Any, index: int) -> Any:
    """Choice ``index`` of an ``n > 1`` request, as vLLM's ``ParentRequest`` makes it: ``n = 1``
    and, when seeded, ``seed + index``."""
    child = copy.copy(params)
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def continuation_params(params: Any, delivered_ids: list[int], engines: Engines = Engines()) -> Any:
    """``params`` for the rest of a request after ``delivered_ids`` reached the client.

    The delivered tokens travel in ``extra_args[RESUME_IDS_KEY]``: the new engine's grammar
    accepts them before its first step (``executor.resume``) and its workers count them as the
    request's past (``executor.history``).

    After a seam the new engine produces token ids only: stop strings are checked and the
    text is made by a ``SeamText`` that has seen the whole sequence, so the engine neither
    detokenizes nor looks for stop strings (its detokenizer would start cold at the seam)."""
    delivered = len(delivered_ids)
    if delivered == 0:
        return copy.deepcopy(params)  # the engine may have mutated the one it was given
    reason = why_not_continuable(params, engines)
    if reason:
        raise NotContinuable(reason)
    remaining = params.max_tokens - delivered
    if remaining < 1:
        raise NotContinuable("no token budget left")
    sub = copy.deepcopy(params)
    sub.max_tokens = remaining
    sub.min_tokens = max(0, (params.min_tokens or 0) - delivered)
    sub.stop = []
    sub.prompt_logprobs = None  # delivered with the first output; the prompt is now longer
    sub.output_text_buffer_length = 0
    sub.detokenize = False
    sub.extra_args = {**(params.extra_args or {}), RESUME_IDS_KEY: list(delivered_ids)}
    return sub


class SeamText:
    """The client's text after a seam, from one detokenizer that has seen the original
    prompt and every token delivered so far (vLLM's own incremental detokenizer, built for
    the original request). It also checks the original stop strings on the joined text.

    ``detokenizer`` is fresh (built from the original prompt and parameters); it is
    brought up to the seam by replaying the delivered tokens, and the text it makes of them
    must equal what the client already received."""

    def __init__(self, detokenizer: Any, delivered_ids: list[int], delivered_text: str):
        self._detok = detokenizer
        if delivered_ids:
            detokenizer.update(list(delivered_ids), False)
        replayed = detokenizer.get_next_output_text(False, False)
        if replayed != delivered_text:
            raise NotContinuable(
                f"the text delivered so far ({len(delivered_text)} chars) does not replay "
                f"({len(replayed)} chars)")
        self._emitted = len(delivered_text)

    def step(self, new_ids: list[int], finish_reason: str | None,
             stop_reason: Any = None) -> tuple[str, list[int], str | None, Any]:
        """One engine output after the seam → (text delta, token ids delta, finish reason,
        stop reason) exactly as the original engine would have produced them. A stop string
        that completes here finishes the request (the caller stops reading the engine)."""
        d = self._detok
        before = d.num_output_tokens()
        stop_string = d.update(list(new_ids), finish_reason == "stop")
        ids = list(d.output_token_ids[before:])
        if stop_string is not None:
            finish_reason, stop_reason = "stop", stop_string
        full = d.get_next_output_text(finish_reason is not None, False)
        text, self._emitted = full[self._emitted:], len(full)
        return text, ids, finish_reason, stop_reason


class SeamLogprobs:
    """The sampled tokens' logprobs after a seam, as the original engine would have given
    them. The new engine computes the values (its prefix is the prompt + the delivered
    tokens) but does not detokenize: the token strings are made here, by vLLM's own
    functions (``token_strings(tokenizer, ids, context)``), with the delivered tokens as
    the context a byte-fallback piece is completed with; the cumulative logprob carries on."""

    def __init__(self, token_strings: Any, tokenizer: Any, delivered_ids: list[int], cumulative: float | None):
        self._strings = token_strings
        self._tokenizer = tokenizer
        self._context = list(delivered_ids)
        self._cumulative = cumulative or 0.0

    def step(self, logprobs: list[dict[int, Any]] | None, ids: list[int],
             cumulative: float | None) -> tuple[list[dict[int, Any]] | None, float | None]:
        """One engine output's ``logprobs`` (a dict per new token, the sampled one first) for
        the token ids the client reads (``ids``) -> the same with their token strings, and
        the cumulative logprob since the original request began."""
        if logprobs is None:
            return None, None
        out = []
        for position, sampled in zip(logprobs, ids):
            strings = self._strings(self._tokenizer, list(position), self._context)
            out.append({t: replace(lp, decoded_token=s) for (t, lp), s in zip(position.items(), strings)})
            self._context.append(sampled)
        return out, self._cumulative + (cumulative or 0.0)
