"""The cluster watch over a real TCP listener standing in for the GCS: a healthy GCS costs one
connection a second (it was five), a GCS process that dies is seen at once through the
connection the watch holds, and a server that closes idle connections (gRPC's handshake
timeout) is not a loss."""

from __future__ import annotations

import asyncio
import time

from health import clusterwatch
from health.clusterwatch import ClusterWatch


class View:
    """``health.view.WatchView`` for one address."""

    def __init__(self, address: str):
        self.gcs_address = address
        self.cluster_lost = False
        self.agent_pid = 1
        self.gcs_lost_after_s = 0.5
        self.events: list = []
        self.posted_at: list[float] = []

    def agent_alive(self) -> bool:
        return True

    def terminal(self) -> bool:
        return False

    def post(self, event) -> None:
        self.events.append(event)
        self.posted_at.append(time.monotonic())
        self.cluster_lost = True


class Gcs:
    """A listener that accepts and holds connections; ``close_after_s``: it closes each one
    that long after accepting it, as gRPC does after 120 s without a request."""

    def __init__(self, close_after_s: float | None = None):
        self.accepted = 0
        self.open: list[asyncio.StreamWriter] = []
        self.close_after_s = close_after_s

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader, writer) -> None:
        self.accepted += 1
        self.open.append(writer)
        writer.write(b"\x00" * 46)  # gRPC sends its settings frame at once
        if self.close_after_s is not None:
            await asyncio.sleep(self.close_after_s)
            writer.close()

    def die(self) -> None:
        """Stops listening, then its sockets close, as when the process is killed."""
        self.server.close()
        for w in self.open:
            w.close()


def test_a_healthy_gcs_costs_a_connection_a_second_and_one_is_held():
    async def scenario():
        gcs = Gcs()
        view = View(await gcs.start())
        watch = ClusterWatch(view)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(3.1)
        assert 3 <= gcs.accepted <= 4, gcs.accepted  # 15 with a connection every 0.2 s
        assert watch.held is not None and not watch.held.ended.is_set() and not view.events
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)
        assert watch.held is None  # its connection closed with it
        gcs.die()

    asyncio.run(scenario())


def test_a_dead_gcs_is_seen_at_once_and_lost_after_gcs_lost_after_s():
    async def scenario():
        gcs = Gcs()
        view = View(await gcs.start())
        task = asyncio.create_task(ClusterWatch(view).run())
        await asyncio.sleep(0.5)
        died = time.monotonic()
        gcs.die()
        await asyncio.sleep(1.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert len(view.events) == 1, view.events
        lost = view.events[0]
        # seen through the held connection's end, not at the next check (up to CHECK_S later)
        assert lost.detected_monotonic - died < 0.3, lost.detected_monotonic - died
        assert view.posted_at[0] - lost.detected_monotonic >= view.gcs_lost_after_s

    asyncio.run(scenario())


def test_a_gcs_that_closes_idle_connections_is_not_lost():
    async def scenario():
        gcs = Gcs(close_after_s=0.3)
        view = View(await gcs.start())
        watch = ClusterWatch(view)
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(2.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not view.events and watch.down_since is None
        assert gcs.accepted >= 5  # each close was followed by a new connection at once
        gcs.die()

    asyncio.run(scenario())


def test_a_proxy_that_accepts_and_closes_at_once_is_not_hammered():
    async def scenario():
        gcs = Gcs(close_after_s=0.0)
        view = View(await gcs.start())
        task = asyncio.create_task(ClusterWatch(view).run())
        await asyncio.sleep(2.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert gcs.accepted <= 11, gcs.accepted  # a connection per INTERVAL_S at most
        gcs.die()

    asyncio.run(scenario())


def test_listening_answers_for_an_address_without_holding_it():
    async def scenario():
        gcs = Gcs()
        address = await gcs.start()
        assert await clusterwatch.listening(address) is None
        gcs.die()
        await asyncio.sleep(0.05)
        assert await clusterwatch.listening(address) is not None
        assert await clusterwatch.listening("ray://somewhere") is None  # not a host:port: nothing to watch

    asyncio.run(scenario())
