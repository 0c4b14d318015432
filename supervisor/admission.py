"""Admission: which serving generation a request starts (or continues) on, and when it waits.

A new request waits for a serving generation in a bounded queue (``admission_queue_size``)
up to ``admission_timeout_s``, else it is a 503; a parked request (its engine failed
mid-stream) waits up to ``recovery_timeout_s``, else it fails. A stopping daemon refuses new
requests at once. A parked request that fails here raises ``RequestFailed``, counted by its stream.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from supervisor import aio
from supervisor.dispatch import Dispatcher
from supervisor.generation import EngineUnavailable, Generation, RequestFailed
from supervisor.states import State

_RESERVATION_S = 10.0  # an admission slot reserved by reserve(), unused, is freed after this


class Admission:
    """The admission queue of one request path (``SupervisedEngineClient``)."""

    def __init__(self, dispatcher: Dispatcher):
        self.d = dispatcher
        self.waiting_new = 0  # new requests queued for admission
        self.parked = 0  # in-flight requests waiting for the next generation
        self._reserved: collections.deque[float] = collections.deque()  # slots taken by reserve()

    def reserve(self) -> None:
        """A slot in the admission queue for a request whose ``generate`` comes later (the
        front awaits, rendering the prompt, in between): a burst gets its 503s now, as a
        status, not in a started stream."""
        now = time.monotonic()
        while self._reserved and now - self._reserved[0] > _RESERVATION_S:
            self._reserved.popleft()
        self.refuse_new(self.waiting_new + len(self._reserved))
        self._reserved.append(now)

    def claim_reservation(self) -> None:
        """A request arrived: its slot is now counted in ``waiting_new``, if it waits."""
        if self._reserved:
            self._reserved.popleft()

    def refuse_new(self, waiting: int) -> None:
        """A new request gets a 503 while the daemon stops or ``waiting`` fills the admission queue."""
        d = self.d
        if d.state.terminal or d.state is State.STOPPING:
            d.count_outcome("rejected")
            raise EngineUnavailable(f"daemon is {d.state.value}: {d.reason}")
        if waiting >= d.cfg.admission_queue_size:
            d.count_outcome("rejected")
            raise EngineUnavailable(f"daemon is {d.state.value} and its admission queue is full ({d.cfg.admission_queue_size})")

    async def admit(self, parked: bool, not_gens: tuple[Generation, ...] = (), token_ids: Any = None,
                    replica: int | None = None) -> Generation:
        """A serving generation once READY (and none of ``not_gens``, the generations the
        request saw die, before the owner task marked them failed; of ``replica`` when given). ``token_ids``:
        the prompt, for prefix-aware routing between replicas."""
        d = self.d
        if (gen := d.pick(not_gens, parked, token_ids, replica)) is not None:
            return gen
        if parked and (d.state.terminal or d.state is State.STOPPING):
            raise RequestFailed(f"daemon is {d.state.value} ({d.reason}); retry the request elsewhere")
        if not parked:
            self.refuse_new(self.waiting_new)
        timeout = d.cfg.recovery_timeout_s if parked else d.cfg.admission_timeout_s
        deadline = time.monotonic() + timeout
        if parked:
            self.parked += 1
        else:
            self.waiting_new += 1
        try:
            while True:
                if (gen := d.pick(not_gens, parked, token_ids, replica)) is not None:
                    return gen
                if d.state.terminal or d.state is State.STOPPING:
                    return await self.admit(parked, not_gens, token_ids, replica)
                left = deadline - time.monotonic()
                if left <= 0:
                    if parked:
                        raise RequestFailed(f"no engine within {timeout:g} s ({d.reason}); retry the request")
                    d.count_outcome("rejected")
                    raise EngineUnavailable(f"daemon is {d.state.value} ({d.reason}); no engine within {timeout:g} s")
                d.changed.clear()
                try:
                    await aio.wait_for(d.changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            if parked:
                self.parked -= 1
            else:
                self.waiting_new -= 1
