"""Deterministic fault points for the chaos tier; inert unless the daemon is started with
``VLLM_SUPERVISOR_TEST_HOOKS=1``.

Hold at a mid-character token: a request that carries
``vllm_xargs={"supervisor_test_hold_midchar": N}`` stops on its first engine, once at least
``N`` tokens reached the client, right after the first token whose bytes end inside a UTF-8
character, and waits there until its engine fails (``/readyz?verbose`` counts the streams
held as ``test_held``). A test kills a worker when every request is held, so every seam
falls inside a multi-byte character. Only for byte-level BPE tokenizers (the demo model's).
``vllm_xargs={"supervisor_test_hold_after": N}`` holds right after the ``N``-th token instead.
``"supervisor_test_hold_engines": K`` beside either holds on each of the first ``K`` engines
the request runs on (default 1), so a test can kill every engine under the same requests
without racing their remaining tokens; on a later engine ``N`` counts the outputs read from
it, so the request is established there when it holds (``supervisor.suspects``).

Without the step clock (``VLLM_SUPERVISOR_TEST_TOKEN_CLOCK=1``): tokens are the probe's clock.

Parts of the warm standby left out (``VLLM_SUPERVISOR_TEST_STANDBY_WITHOUT=starter,idle,poll,preload,park``), so
that ``bench.serving_overhead`` measures what each costs a serving engine (``standby_without``).

The executor's own hooks (which death report comes first) live in ``executor.testhooks``."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from executor.testhooks import ENV, enabled  # noqa: F401 - one switch for both layers

HOLD_MIDCHAR = "supervisor_test_hold_midchar"
HOLD_AFTER = "supervisor_test_hold_after"
HOLD_ENGINES = "supervisor_test_hold_engines"
TOKEN_CLOCK_ENV = "VLLM_SUPERVISOR_TEST_TOKEN_CLOCK"
STANDBY_WITHOUT_ENV = "VLLM_SUPERVISOR_TEST_STANDBY_WITHOUT"
STANDBY_PARTS = ("starter", "idle", "poll", "preload", "park", "rest", "freeze")


def token_clock_only() -> bool:
    """Build engines without the step clock (``VLLM_SUPERVISOR_TEST_TOKEN_CLOCK=1`` with the
    hooks on): the probe then judges a busy engine by its tokens, as it did before the step
    clock, which ``bench.hang_detection`` shows against the step clock on a long prefill.
    (``--disable-log-stats`` cannot: vLLM turns its stats back on for a registered logger.)"""
    import os

    return enabled() and os.environ.get(TOKEN_CLOCK_ENV, "") == "1"


def standby_without() -> frozenset[str]:
    """The warm standby's parts left out (``VLLM_SUPERVISOR_TEST_STANDBY_WITHOUT``, a comma list,
    with the hooks on): ``starter``, each build's workers created by vLLM's executor, as with
    ``standby = "none"``, not through the Ray agent; ``idle``, no standby prepared after a
    build (no fork server, idle worker or liveness poll); ``poll``, a ready standby's liveness
    not polled; ``preload``, the Ray agent not importing the worker class (vLLM, torch) ahead
    of the first creation (with ``starter`` and ``idle`` out: never); ``park``, a ready standby's
    workers not parked (``executor.standby``: they wait awake, as any Ray actor); ``rest``, a ready
    standby's processes left at the normal scheduling policy (``supervisor.standby_sched``);
    ``freeze``, a ready standby's workers left running (not stopped, ``standby_sched.stop``). An unknown part is an error, so a bench cannot measure a misspelt one."""
    import os

    if not enabled():
        return frozenset()
    parts = frozenset(p.strip() for p in os.environ.get(STANDBY_WITHOUT_ENV, "").split(",") if p.strip())
    unknown = parts - set(STANDBY_PARTS)
    if unknown:
        raise ValueError(f"{STANDBY_WITHOUT_ENV}: unknown standby part(s) {sorted(unknown)}; known: {', '.join(STANDBY_PARTS)}")
    return parts


def _count(params: Any, key: str) -> int | None:
    """The request's ``vllm_xargs[key]`` as a count (digits only), or None."""
    value = (getattr(params, "extra_args", None) or {}).get(key)
    return int(value) if isinstance(value, (int, float, str)) and str(value).isdigit() else None


def hold_midchar_after(params: Any) -> int | None:
    """The request's hold threshold (tokens), or None."""
    return _count(params, HOLD_MIDCHAR)


def hold_point(params: Any) -> tuple[int, bool] | None:
    """(tokens, mid-character only) at which the request holds, or None: ``HOLD_MIDCHAR``
    holds at the first token that ends inside a character once that many were delivered,
    ``HOLD_AFTER`` right after that many (output that may never split a character, e.g. JSON)."""
    midchar = hold_midchar_after(params)
    if midchar is not None:
        return midchar, True
    after = _count(params, HOLD_AFTER)
    return (after, False) if after is not None else None


def hold_engines(params: Any) -> int:
    """On how many of its engines (its first ones) the request holds: 1 unless it says."""
    engines = _count(params, HOLD_ENGINES)
    return engines if engines is not None else 1


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character → byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def ends_mid_character(tokenizer: Any, token_ids: list[int]) -> bool:
    """Whether the bytes of ``token_ids`` end with an incomplete (but so far valid) UTF-8
    sequence: a lead byte followed by fewer continuation bytes than it announces."""
    decoder = _byte_decoder()
    tail = bytearray()
    for token in tokenizer.convert_ids_to_tokens(token_ids[-4:]):
        if token is None or any(ch not in decoder for ch in token):
            return False  # special or non-byte-level token
        tail += bytes(decoder[ch] for ch in token)
    for back in range(1, min(4, len(tail)) + 1):
        byte = tail[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 0
        return need > back
    return False
