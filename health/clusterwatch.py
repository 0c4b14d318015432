"""The cluster watch: finds a lost Ray GCS within about a second, without asking Ray, and a
Ray agent that died on its own (OOM, a crash): both are a ``ClusterLost``.

The daemon holds a TCP connection to the GCS address it is connected to, on its event loop,
and opens a fresh one every ``CHECK_S``, which it holds instead. The held connection ends the
moment the GCS process dies (its sockets close with it: measured 20 ms), and the watch connects
again at once; the fresh connection finds a GCS that no longer accepts without closing what it
held (a host or a route gone). While connecting fails, it tries every ``INTERVAL_S``, and never
connects more often than that (a proxy may accept and close at once). A GCS that refuses or does
not accept for ``ray.gcs_lost_after_s`` on end is lost: one ``ClusterLost`` is posted to the
owner task, which kills the Ray agent before a new GCS can answer it (``executor.rayagent``
says why) and waits for the cluster to come back. (A connection every 0.2 s, as before, cost
the GCS 0.5 ms of CPU each: 0.25 % of a core, idle or not.) The watch sees the daemon only through ``health.view.WatchView``, and never calls
Ray: a Ray call to a GCS that is gone blocks for up to a minute, and one in flight when a new
GCS starts on the address aborts its process.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from health.events import ClusterLost
from health.view import WatchView

log = structlog.get_logger("vllm_supervisor.clusterwatch")

INTERVAL_S = 0.2  # the agent's check, and a connect while the GCS does not accept
CHECK_S = 1.0  # a fresh connection while one is held
CONNECT_TIMEOUT_S = 1.0
# An outage's first failed check comes at most about this long after the GCS stopped
# answering: the next fresh connection (CHECK_S, on the INTERVAL_S tick) and its timeout, with a
# tick of slack for the event loop (a GCS process that died: at once, its held connection ends).
SEEN_LATE_S = CHECK_S + 2 * INTERVAL_S + CONNECT_TIMEOUT_S


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port`` (the GCS address Ray reports) → (host, port); None for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


class _Held(asyncio.Protocol):
    """A connection to the GCS that sends nothing and discards what it reads (gRPC's settings
    frame, its goaway): ``ended`` is set the moment the other side closes it."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self.ended.set()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended.set()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def _connect(address: str, timeout_s: float) -> tuple[_Held | None, str | None]:
    """(the open connection, None), or (None, what went wrong); (None, None) when ``address``
    is not a host:port (a Ray client address): nothing to watch."""
    target = split_address(address)
    if target is None:
        return None, None
    try:
        async with asyncio.timeout(timeout_s):
            _, held = await asyncio.get_running_loop().create_connection(_Held, *target)
    except TimeoutError:
        return None, f"no answer from {address} within {timeout_s:g} s"
    except OSError as exc:
        return None, exc.strerror or str(exc)
    return held, None


async def listening(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when something accepts a TCP connection at ``address``, else what went wrong."""
    held, problem = await _connect(address, timeout_s)
    if held is not None:
        held.close()
    return problem


class ClusterWatch:
    def __init__(self, view: WatchView):
        self.view = view
        self.down_since: float | None = None  # first failed check of the current outage
        self.held: _Held | None = None  # a connection to the GCS, while it accepts
        self.held_address: str | None = None
        self.checked = 0.0  # when the last connection was opened (monotonic)

    def _dropped(self) -> bool:
        """The held connection ended: the GCS (or something in front of it) closed it."""
        return self.held is not None and self.held.ended.is_set()

    def _let_go(self) -> None:
        if self.held is not None:
            self.held.close()
        self.held, self.held_address = None, None

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self._let_go()

    async def _run(self) -> None:
        view = self.view
        while True:
            await self._wait(INTERVAL_S)
            address = view.gcs_address
            if not address or view.cluster_lost or view.terminal():
                self.down_since = None
                self._let_go()
                continue
            agent_pid = view.agent_pid
            if not view.agent_alive():
                view.post(ClusterLost(address, "the Ray agent died", time.monotonic(), agent_pid))
                continue
            if address != self.held_address or self._dropped():
                self._let_go()
            elif time.monotonic() - self.checked < CHECK_S:
                continue
            # never more than a connection every INTERVAL_S: a proxy in front of the GCS (a port
            # forward, a sidecar) may accept and close at once, again and again
            if (pause := self.checked + INTERVAL_S - time.monotonic()) > 0:
                await asyncio.sleep(pause)
            self.checked = time.monotonic()
            held, problem = await _connect(address, CONNECT_TIMEOUT_S)
            if problem is None:
                self.down_since = None
                if held is not None:  # the fresh connection is held from now on
                    self._let_go()
                    self.held, self.held_address = held, address
                continue
            self._let_go()
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
                log.warning("ray gcs not answering", address=address, problem=problem)
            if now - self.down_since >= view.gcs_lost_after_s and not view.cluster_lost:
                view.post(ClusterLost(address, problem, self.down_since, agent_pid))  # the owner ignores repeats
                self.down_since = None

    async def _wait(self, seconds: float) -> None:
        """``seconds``, or less: until the held connection ends."""
        if self.held is None or self.held.ended.is_set():
            await asyncio.sleep(seconds)
            return
        try:
            async with asyncio.timeout(seconds):
                await self.held.ended.wait()
        except TimeoutError:
            pass
