"""Typed events from the executor (inside vLLM's engine-core process) to the supervisor.

Transport: a pyzmq PUSH socket in the executor, connected to the supervisor's PULL
socket on a local IPC path. Messages are JSON, never pickle. This module imports
neither Ray nor vLLM, so the supervisor and the unit tests can use it freely.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

# Key in ``VllmConfig.additional_config`` that carries the supervisor's wiring into the
# engine-core process (the config object is what crosses that process boundary).
ADDITIONAL_CONFIG_KEY = "vllm_supervisor"


def wiring(vllm_config: Any) -> dict:
    """The supervisor's wiring in ``vllm_config`` (``executor.engine.build_engine`` writes it):
    empty for an engine the daemon did not build (``vllm serve`` with our executor class)."""
    return dict((getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY) or {})


@dataclass(frozen=True)
class WorkerDeathEvent:
    """One or more worker actors of engine ``generation`` died."""

    generation: int
    ranks: list[int]
    actor_names: list[str]
    node_ids: list[str]
    cause: str
    detected_monotonic: float = field(default_factory=time.monotonic)
    pid: int = field(default_factory=os.getpid)
    kind: str = "worker_death"

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "WorkerDeathEvent":
        data = json.loads(raw)
        if data.get("kind") != "worker_death":
            raise ValueError(f"not a worker_death event: {data.get('kind')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def publish(endpoint: str, event: WorkerDeathEvent, timeout_s: float = 2.0) -> None:
    """Send one event and wait (bounded) until it is handed to the transport."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, int(timeout_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        sock.connect(endpoint)
        sock.send(event.to_json())
    finally:
        sock.close()
