"""A query of death: the request that crashes whatever engine runs it, found and kept out.

Being in flight at a failure is weak evidence: long innocent streams are in flight at every
failure too. What the daemon can see is which choices were *new* on the failed engine: those
that had read fewer than ``ESTABLISHED`` outputs from it. A request that crashes an engine does
so in its first steps there (its prefill, or its first tokens); the established ones ran good
steps with the engine before. The rules, per failure of a generation:

===========================================  ==============================================
the choices in flight on it                   what each of them counts
===========================================  ==============================================
some new                                      each new one is *implicated* (and interrupted);
                                              the established ones count nothing
none new (a plain fault, or a crash no new    each one is interrupted, as before this module
request explains)                             (``continuation_limit`` bounds interruptions)
===========================================  ==============================================

* A choice implicated by failures of **two different generations** is the culprit, when at the
  second it was the only one new there that was already on probation (several on probation new
  together, after their wait ran out, tell nothing apart: none of them counts that failure as a
  second one). The culprit is quarantined (a final, non-retriable error) and its input's fingerprint is refused at
  admission for ``quarantine_window_s``.
* An implicated choice is *on probation*: it joins an engine only when no choice there is new
  (each has read ``ESTABLISHED`` outputs) and none is still waiting to join, so that the next failure names it alone and not the
  innocents continued beside it. With replicas it waits for its own replica's next generation:
  a culprit never takes a second replica down.
* A new request joins an engine only when no *continued* choice there is new: a fresh poison
  arriving right after a recovery must not implicate the innocents just continued. (An engine
  that took no continued choice, the steady state, admits at once.)
* Both wait at most ``PROBATION_WAIT_S``; a continued choice that was not implicated joins at once.

Pure logic: ``supervisor.stream`` applies it to each choice, the owner keeps the quarantine
(``supervisor.daemon``).
"""

from __future__ import annotations

import collections
import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

ESTABLISHED = 4  # outputs a choice has read from an engine before it is no longer new there
PROBATION_WAIT_S = 5.0  # the longest a choice on probation waits for the others to be established


@dataclass(frozen=True)
class Verdict:
    """What one failure of a generation says about the choices that were in flight on it."""

    implicated: frozenset[str]  # the new ones
    plain: bool  # none was new: every one counts an interruption
    singles_out: bool = True  # at most one of the new ones was already on probation


def verdict(outputs: Mapping[str, int], on_probation: Iterable[str] = ()) -> Verdict:
    """The verdict of a failure from each in-flight choice's outputs read from the failed
    engine (``{choice id: outputs}``) and which of them were on probation."""
    new = frozenset(c for c, n in outputs.items() if n < ESTABLISHED)
    return Verdict(new, plain=not new, singles_out=len(new.intersection(on_probation)) <= 1)


def blocking(joining: "Record", others: Iterable["Record"], parked: int = 0) -> int:
    """How many choices keep ``joining`` from joining an engine now (``others``: those on it;
    ``parked``: those still waiting for an engine, continued ones that will join it): for one on
    probation, every new one and every parked one; for a new request, every new continued one;
    else none."""
    if joining.on_probation:
        return parked + sum(1 for r in others if r.outputs_here < ESTABLISHED)
    if joining.joined == 0:
        return sum(1 for r in others if r.continued and r.outputs_here < ESTABLISHED)
    return 0


def may_join(blocked_by: int, waited_s: float) -> bool:
    """Whether a choice joins an engine now: nothing blocks it, or it waited ``PROBATION_WAIT_S``."""
    return blocked_by == 0 or waited_s >= PROBATION_WAIT_S


class Record:
    """One choice's part in failures (``Carryover.suspect``)."""

    def __init__(self) -> None:
        self.implicated: list[int] = []  # generations whose failure implicated it
        self.interruptions = 0  # failures it counts against continuation_limit
        self.outputs_here = 0  # outputs read from its current engine
        self.joined = 0  # engines it joined

    @property
    def on_probation(self) -> bool:
        return bool(self.implicated)

    @property
    def continued(self) -> bool:
        return self.joined > 1

    def failed(self, generation: int, choice: str, v: Verdict) -> bool:
        """Its engine generation ``generation`` failed with verdict ``v``; True when this makes
        it the culprit (implicated by two different generations)."""
        if choice in v.implicated:
            if generation not in self.implicated and (not self.implicated or v.singles_out):
                self.implicated.append(generation)
            self.interruptions += 1
        elif v.plain:
            self.interruptions += 1
        return len(self.implicated) >= 2


def fingerprint(prompt_ids: Any, params: Any) -> str:
    """A hash of a request's input: its prompt tokens and sampling parameters (not how its
    output is delivered), the same for the same request sent again. Logged instead of the prompt."""
    # vLLM's SamplingParams is a msgspec struct: its fields are not in ``vars()``
    fields = getattr(type(params), "__struct_fields__", None)
    items = {k: getattr(params, k) for k in fields} if fields is not None else vars(params)
    keep = {k: v for k, v in sorted(items.items())
            if k not in ("output_kind", "extra_args", "skip_clone") and not k.startswith("_")}
    extra = {k: v for k, v in sorted((getattr(params, "extra_args", None) or {}).items())
             if not k.startswith("vllm_supervisor_") and not k.startswith("supervisor_test_hold")}
    text = repr((list(prompt_ids or ()), keep, extra))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Quarantine:
    """Inputs that crashed two engines, refused at admission for ``window_s`` (the newest
    ``size`` of them)."""

    def __init__(self, window_s: float, size: int, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.size, self.clock = window_s, size, clock
        self._since: collections.OrderedDict[str, float] = collections.OrderedDict()

    def add(self, print_: str) -> None:
        self._since.pop(print_, None)
        self._since[print_] = self.clock()
        while len(self._since) > self.size:
            self._since.popitem(last=False)

    def __contains__(self, print_: str) -> bool:
        since = self._since.get(print_)
        if since is None:
            return False
        if self.clock() - since > self.window_s:
            del self._since[print_]
            return False
        return True

    def __len__(self) -> int:
        return len(self._since)
