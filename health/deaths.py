"""The worker-death listener: the ``WorkerDeathEvent``s that the executor (in vLLM's engine-core
process) pushes over zmq (``executor.events``) become ``EngineFailed(…, "worker_death", …)``,
posted to the owner task."""

from __future__ import annotations

import os
from typing import Callable

import structlog
import zmq
import zmq.asyncio

from executor.events import WorkerDeathEvent
from health.events import EngineFailed

log = structlog.get_logger("vllm_supervisor.deaths")


async def listen_for_worker_deaths(endpoint: str, post: Callable[[EngineFailed], None]) -> None:
    """Bind a PULL socket at ``endpoint`` (``ipc://…``, owner-only) and post each death it reads."""
    sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
    sock.bind(endpoint)
    os.chmod(endpoint.removeprefix("ipc://"), 0o600)
    try:
        while True:
            raw = await sock.recv()
            try:
                ev = WorkerDeathEvent.from_json(raw)
            except (ValueError, TypeError) as exc:
                log.warning("malformed executor event", error=str(exc))
                continue
            detail = f"rank(s) {ev.ranks} ({', '.join(ev.actor_names)}): {ev.cause}"
            post(EngineFailed(ev.generation, "worker_death", detail, ev.detected_monotonic, ranks=tuple(ev.ranks)))
    finally:
        sock.close(linger=0)
