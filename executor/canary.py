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

A reader waiting on the ring's notification re-reads the ring every
``SHM_READER_RECHECK_INTERVAL_MS`` in case it missed one (vLLM: 5 s); here every
``READER_RECHECK_MS`` (1 s, ``bound_lost_wakeup``), in the engine core and in each worker.
A missed notification then delays a healthy step by at most a second, not five, which is
what lets the probe call a busy engine hung after 4 s without stepping (``hang_timeout_s``).
The cost: an idle reader checks one flag once a second instead of once in five.
"""

from __future__ import annotations

from typing import Any

CANARY_PREFIX = "probe-"  # the request ids of the supervisor's idle canary (supervisor.engine_client)
READER_RECHECK_MS = 1000  # a ring reader that missed its notification reads again after this


def bound_lost_wakeup() -> None:
    """Make this process's ring readers re-read at least every ``READER_RECHECK_MS`` (vLLM reads
    the module constant on every wait)."""
    from vllm.distributed.device_communicators import shm_broadcast

    current = getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None)
    if isinstance(current, int) and current > READER_RECHECK_MS:
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = READER_RECHECK_MS


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


class CanaryIdle:
    """A vLLM worker (``WorkerProc``: the ``mp`` executor's, and Ray V2's ``RayWorkerProc``)
    that, after the empty step freeing a step that held only canaries, waits for the next step
    without spinning (``go_idle``)."""

    _canary_step = False

    def _execute_worker_rpc(self, rpc_request: tuple) -> None:
        super()._execute_worker_rpc(rpc_request)  # type: ignore[misc]
        method, args, kwargs = rpc_request[0], rpc_request[1], rpc_request[2]
        if method != "execute_model":
            return
        serves = step_serves_clients(args[0] if args else kwargs.get("scheduler_output"))
        if serves is None and self._canary_step:
            # the empty step that frees a finished canary ends its work: wait without spinning
            # (not sooner: the empty step is written while the canary's last reply is read)
            go_idle(self.rpc_broadcast_mq)  # type: ignore[attr-defined]
        self._canary_step = serves is False
