"""The cluster watch: finds a lost Ray GCS within about a second, without asking Ray, and a
Ray agent that died on its own (OOM, a crash): both are a ``ClusterLost``.

Every ``INTERVAL_S`` the daemon opens (and closes) a TCP connection to the GCS address it is
connected to, on its event loop. A GCS that refuses or does not accept for
``ray.gcs_lost_after_s`` on end is lost: one ``ClusterLost`` is posted to the owner task, which
kills the Ray agent before a new GCS can answer it (``executor.rayagent`` says why) and waits
for the cluster to come back. The watch sees the daemon only through ``health.view.WatchView``,
and never calls Ray: a Ray call to a GCS that is gone blocks for up to a minute, and one in
flight when a new GCS starts on the address aborts its process.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from health.events import ClusterLost
from health.view import WatchView

log = structlog.get_logger("vllm_supervisor.clusterwatch")

INTERVAL_S = 0.2
CONNECT_TIMEOUT_S = 1.0
# An outage's first failed check comes at most this long after the GCS stopped answering.
SEEN_LATE_S = INTERVAL_S + CONNECT_TIMEOUT_S


def split_address(address: str) -> tuple[str, int] | None:
    """``host:port`` (the GCS address Ray reports) → (host, port); None for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


async def listening(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when something accepts a TCP connection at ``address``, else what went wrong."""
    target = split_address(address)
    if target is None:
        return None  # not a host:port (a Ray client address): nothing to watch
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(*target)
    except TimeoutError:
        return f"no answer from {address} within {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return None


class ClusterWatch:
    def __init__(self, view: WatchView):
        self.view = view
        self.down_since: float | None = None  # first failed check of the current outage

    async def run(self) -> None:
        view = self.view
        while True:
            await asyncio.sleep(INTERVAL_S)
            address = view.gcs_address
            if not address or view.cluster_lost or view.terminal():
                self.down_since = None
                continue
            agent_pid = view.agent_pid
            if not view.agent_alive():
                view.post(ClusterLost(address, "the Ray agent died", time.monotonic(), agent_pid))
                continue
            problem = await listening(address)
            if problem is None:
                self.down_since = None
                continue
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
                log.warning("ray gcs not answering", address=address, problem=problem)
            if now - self.down_since >= view.gcs_lost_after_s and not view.cluster_lost:
                view.post(ClusterLost(address, problem, self.down_since, agent_pid))  # the owner ignores repeats
                self.down_since = None
