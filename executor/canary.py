"""The supervisor's idle canary as the workers see it, and what it must not cost.

The probe sends a one-token request now and then while the engine is idle
(``supervisor.engine_client.canary``, request ids ``CANARY_PREFIX…``). Each vLLM worker reads
its steps from a shared-memory ring and, after every read, spins on it for a second
(``shm_broadcast.SpinCondition``, ``busy_loop_s = 1``) so that the next decode step is picked
up without a wake-up. Under load that is what the spin is for; after a canary it only burns the
core (half a core per worker with a canary every 2 s, ``bench/results/executor-idle.md``). A
worker whose last step held only canaries goes back to waiting on the ring's notification at
once (``go_idle``): the next real step wakes it as it wakes a worker idle for more than a
second, which is what an idle ``vllm serve`` worker is.
"""

from __future__ import annotations

from typing import Any

CANARY_PREFIX = "probe-"  # the request ids of the supervisor's idle canary (supervisor.engine_client)


def step_serves_clients(scheduler_output: Any) -> bool | None:
    """Whether a model step carries a request other than the idle probe's canary (None: a
    step with no request)."""
    ids = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    return any(not str(rid).startswith(CANARY_PREFIX) for rid in ids) if ids else None


def go_idle(mq: Any) -> bool:
    """End the reader's spin on ``mq`` now (the next read waits on the writer's notification);
    False when this vLLM's queue has no such spin."""
    spin = getattr(mq, "_spin_condition", None)
    if spin is None or not hasattr(spin, "last_read"):
        return False
    spin.last_read = 0.0
    return True
