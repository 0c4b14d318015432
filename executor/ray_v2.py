"""``SupervisedRayExecutor``: vLLM's ``RayExecutorV2`` with CPU support and death events.

Runs inside vLLM's engine-core process (the supervisor passes the class as the
engine's ``distributed_executor_backend``). Differences from the parent, each
contained here:

* CPU platform: the platform's ``ray_device_key`` is ``""`` on CPU, so it is set to
  ``"CPU"``; actors ask for ``num_gpus=0`` (the placement-group bundle already
  reserves the core); the worker reports no accelerator ids; with replicas, each lone
  worker's OpenMP threads are bound as vLLM's ``mp`` executor binds them under data
  parallelism (``executor.cpu_binding``). On CUDA nothing changes.
* Worker death: the monitor thread's ``shutdown()`` is where the dead ranks are still
  visible, so they are recorded there; the engine's failure callback is wrapped so
  that a typed ``WorkerDeathEvent`` goes to the supervisor first, then the engine's
  own callback runs (vLLM has one callback slot: we chain, never replace).
* Teardown: the workers are killed before vLLM joins its monitor thread, whose 5 s poll
  otherwise held every planned teardown (``_join_monitor_thread``).
* Shared memory: the response queues' ``/dev/shm`` rings are created by the workers,
  which are stopped with ``ray.kill`` and never unlink them; ``shutdown()`` does.
* Standby adoption: where vLLM creates a worker actor, a standby of the same name
  prepared by the supervisor (``executor.standby``) is adopted instead when there is one.
* Idle cost: a worker does not spin on its ring after a step that held only the supervisor's
  canary (``executor.canary``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any

import ray
import vllm.v1.executor.ray_executor_v2 as _v2
from vllm.platforms import current_platform

from executor import canary, history, kv_reserve, resume, testhooks
from executor.cpu_binding import cpu_binding
from executor.events import wiring
from executor.reporting import CAUSE_MAX_CHARS, DeathReporter, Dead

canary.bound_lost_wakeup()  # in the engine core and in every worker: both import this module

# Under vLLM's logger tree: in the engine-core process vLLM's logging config (handler, level,
# the "(EngineCore pid=…)" prefix) applies to these lines too; a logger outside it prints
# warnings only.
logger = logging.getLogger("vllm.supervisor.executor")


class SupervisedRayWorkerProc(canary.CanaryIdle, _v2.RayWorkerProc):
    """The worker actor. On CPU, Ray assigns no accelerator ids. After a step that held only
    the supervisor's idle canary it waits for the next step without spinning
    (``executor.canary``). A continued request's past counts in its sampler (``executor.history``)."""

    _poison_hook: bool | None = None  # the test hooks' query of death (executor.testhooks), read once
    _kv_reserve: Any = None  # a standby's KV memory, faulted in before adoption (executor.kv_reserve)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        history.install()  # a continued request's past counts in this worker's sampler
        super().__init__(*args, **kwargs)

    def _execute_worker_rpc(self, rpc_request: tuple) -> None:
        method, args, kwargs = rpc_request[0], rpc_request[1], rpc_request[2]
        if method == "execute_model":
            if self._poison_hook is None:
                self._poison_hook = testhooks.enabled()
            if self._poison_hook and testhooks.poisoned(args[0] if args else kwargs.get("scheduler_output")):
                logger.error("test hook: a poisoned request entered the batch; this worker dies (pid %d)", os.getpid())
                os.kill(os.getpid(), signal.SIGKILL)
        elif method == "initialize_from_config" and self._kv_reserve is not None:
            with kv_reserve.serving(self._kv_reserve):  # the KV cache in the standby's memory
                super()._execute_worker_rpc(rpc_request)
            return
        super()._execute_worker_rpc(rpc_request)  # canary.CanaryIdle, then vLLM's

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        if current_platform.is_cpu():
            return ray.get_runtime_context().get_node_id(), []
        return super().get_node_and_physical_gpu_ids()


# Ray starts every worker process at nice 15 (its ``worker_niceness``) so that a driver stays
# responsive beside its tasks. A vLLM worker is where the model runs: at nice 15 the engine core,
# the API server and anything else on the host take the cores from it 28 to 1 (CFS weights 1024
# and 36), so each step waits on whatever else is runnable. vLLM's own `mp` executor, what
# `vllm serve` runs by default, starts its workers at the server's priority. The worker reads
# this variable from its environment when it starts (as Ray's job supervisor sets it for its own
# drivers); an operator who wants Ray's default back exports it, e.g. ``RAY_worker_niceness=15``.
NICENESS_VAR = "RAY_worker_niceness"


def worker_niceness() -> str:
    """The niceness a worker actor starts with: the operator's ``RAY_worker_niceness``, else 0."""
    return os.environ.get(NICENESS_VAR, "").strip() or "0"


def set_worker_env(env_vars: dict[str, str], vllm_config: Any) -> None:
    """What every worker actor the daemon's executors create runs with, unless already set: the
    niceness above, and on CPU no inductor (TP>1 otherwise spends ~25 s compiling a helper with
    it on the first request) and vLLM's own OpenMP binding (``executor.cpu_binding``)."""
    env_vars.setdefault(NICENESS_VAR, worker_niceness())
    if current_platform.is_cpu():
        env_vars.setdefault("TORCH_COMPILE_DISABLE", "1")
        for key, value in cpu_binding(vllm_config).items():
            env_vars.setdefault(key, value)


class SupervisedRayExecutor(DeathReporter, _v2.RayExecutorV2):
    """Ray V2 executor that reports worker deaths to the vllm-supervisor daemon."""

    def _init_executor(self) -> None:
        started = time.time()
        self._wire()
        resume.install()  # continued requests' grammars start where they stopped
        # vLLM names the actors after instance_id while they are created; keep that value.
        self._instance_id = self.vllm_config.instance_id
        self._standby_namespace = wiring(self.vllm_config).get("standby_namespace")
        self.adopted: dict[int, int] = {}  # rank -> pid of the standby it adopted
        self._claims: list[Any] = []
        if current_platform.is_cpu():
            current_platform.ray_device_key = "CPU"
        # _init_executor instantiates the module-global class: swap ours in there.
        _v2.RayWorkerProc = SupervisedRayWorkerProc
        real_ray = _v2.ray
        if self._standby_namespace:
            from executor.adoption import AdoptingRay

            _v2.ray = AdoptingRay(real_ray, self._adopt_standby)
        try:
            super()._init_executor()
        finally:
            _v2.ray = real_ray
        logger.info(
            "generation %d: %d Ray worker actor(s) up: %s; adopted standby ranks: %s",
            self._generation,
            len(self.ray_worker_handles),
            self.actor_names(),
            sorted(self.adopted) or "none",
        )
        # One machine-readable line for bench.recovery's phase table (wall-clock times).
        logger.info("executor timing %s", json.dumps({
            "generation": self._generation, "executor_start_unix": started, "executor_s": time.time() - started, "adopted": sorted(self.adopted)}))

    # --- standby adoption -------------------------------------------------------------

    def _adopt_standby(self, options: dict, init_kwargs: dict) -> Any:
        """The standby named ``options["name"]``, adopted with ``init_kwargs``; None when
        there is none or it cannot be adopted (vLLM then creates the actor): among others when
        it was created with other actor options than ``options`` (vLLM's, but for those a
        standby sets otherwise) or initialised CUDA while importing."""
        from executor.adoption import actor_node, binding_change, bundle_node, claim_bundle, option_mismatch
        from executor.cluster import CLAIM_PREFIX, WORKER_PREFIX, kill_handles

        name = options["name"]
        try:
            handle = ray.get_actor(name, namespace=self._standby_namespace)
        except ValueError:
            logger.warning("no standby %s: creating the worker", name)
            return None
        strategy = options["scheduling_strategy"]
        claim, claimed_ids = None, None
        try:
            node_id = bundle_node(strategy.placement_group, strategy.placement_group_bundle_index)
            # Asked of Ray's actor table, not of the standby: a standby on another node may be
            # on one this host cannot reach (a partition, the reason for this very rebuild), and
            # a call to it would wait until Ray marks that node dead (30 s and more).
            if (where := actor_node(handle)) and where != node_id:
                raise RuntimeError(f"it runs on node {where[:12]}, its rank's bundle is on {node_id[:12]}")
            info = ray.get(handle.standby_info.remote())
            differ = option_mismatch(info["created_with"], options)
            if differ or info["cuda_initialized"]:
                reason = (f"created with other settings than vLLM's worker: {', '.join(differ)}" if differ
                          else f"it initialised CUDA while importing (pid {info['pid']})")
                logger.error("standby %s refused: %s", name, reason)
                raise RuntimeError(reason)
            if not current_platform.is_cpu():  # hold the bundle's device for the adopted worker
                resources = {k: v for k, v in _v2.RayExecutorV2._get_actor_resource_kwargs().items()
                             if k in ("num_gpus", "resources")}
                claim, ids = claim_bundle(strategy, name.replace(WORKER_PREFIX, CLAIM_PREFIX, 1), resources,
                                          self._standby_namespace)
                claimed_ids = list(ids)  # Ray's ids as strings (they may be UUIDs)
            # a standby made for another replica's cores is bound to this one's (executor.cpu_binding)
            binding = binding_change(info["created_with"], options)
            pid = ray.get(handle.adopt.remote(node_id, claimed_ids, binding, **init_kwargs))
        except Exception as exc:
            logger.warning("standby %s not adopted (%s): creating the worker", name, exc)
            kill_handles([h for h in (handle, claim) if h is not None])
            return None
        if claim is not None:
            self._claims.append((claim, [pid]))
        self.adopted[init_kwargs["rank"]] = pid
        parking = info.get("parking") or {}
        logger.info("adopted standby %s (pid %d) for rank %d; %s", name, pid, init_kwargs["rank"],
                    f"parked {parking['parks']} time(s), woken by {parking['woken_by']}" if parking.get("parks")
                    else "not parked")
        return handle

    # --- CPU support -----------------------------------------------------------------

    @staticmethod
    def _get_actor_resource_kwargs() -> dict[str, Any]:
        if current_platform.is_cpu():
            return {"num_gpus": 0}
        return _v2.RayExecutorV2._get_actor_resource_kwargs()

    def _build_runtime_env(self) -> dict:
        runtime_env = super()._build_runtime_env()
        set_worker_env(runtime_env.setdefault("env_vars", {}), self.vllm_config)
        return runtime_env

    # --- names -----------------------------------------------------------------------

    def actor_name(self, rank: int) -> str:
        """The Ray actor name of ``rank`` (it carries the generation via ``instance_id``)."""
        tp, pp, pcp = self._get_parallel_sizes()
        return _v2.build_actor_name(self._instance_id, rank, tp, pp, pcp)

    def actor_names(self) -> list[str]:
        return [self.actor_name(h.rank) for h in getattr(self, "ray_worker_handles", [])]

    # --- failure path ----------------------------------------------------------------

    def shutdown(self) -> None:
        # The monitor thread sets is_failed and then calls shutdown(), which kills the
        # surviving actors: record which ranks were dead *before* that.
        if getattr(self, "is_failed", False) and not getattr(self, "shutting_down", True):
            if threading.current_thread().name == "RayWorkerMonitor":
                self._record_death(self._collect_dead_ranks())
        rings = self._response_ring_names()
        super().shutdown()
        _unlink_shm(rings)
        if getattr(self, "_claims", None):
            from executor.cluster import release_claims

            # the workers were killed above; their claims go once their processes have
            release_claims(self._claims)  # logs what each claim saw
            self._claims = []

    def _join_monitor_thread(self) -> None:
        """vLLM's shutdown joins its monitor thread before it kills the workers, and the monitor
        waits in ``ray.wait(timeout=5.0)`` on the workers' ``run()`` refs: every planned
        teardown (a stop, a reload's rebuild) waited up to 5 s for that poll to run out (1.28 s
        in one instrumented stop on 2 cores, 0.00 s with this). Killed first (vLLM kills them
        right after, the same way), the workers' refs resolve, and the monitor, which already
        sees ``shutting_down``, returns without a failure callback. The monitor's own shutdown
        (a worker died) does not join, as in vLLM."""
        if getattr(self, "shutting_down", False) and threading.current_thread().name != "RayWorkerMonitor":
            from executor.cluster import kill_handles

            kill_handles([h.actor for h in getattr(self, "ray_worker_handles", [])])
        super()._join_monitor_thread()

    def _collect_dead_ranks(self) -> list[Dead]:
        handles = [h for h in getattr(self, "ray_worker_handles", []) if h.run_ref is not None]
        if not handles:
            return []
        done, _ = ray.wait([h.run_ref for h in handles], num_returns=len(handles), timeout=0)
        done_set = set(done)
        dead = []
        for h in handles:
            if h.run_ref not in done_set:
                continue
            try:
                ray.get(h.run_ref, timeout=0)
                cause = "run() returned"
            except Exception as exc:  # RayActorError carries Ray's death cause text
                cause = f"{type(exc).__name__}: {exc}"[:CAUSE_MAX_CHARS]
            dead.append((h.rank, self.actor_name(h.rank), h.node_id, cause))
        return dead

    def _response_ring_names(self) -> list[str]:
        """``/dev/shm`` names of the rings the workers created for their replies."""
        names = []
        for mq in getattr(self, "response_mqs", None) or []:
            buffer = getattr(mq, "buffer", None)
            shm = getattr(buffer, "shared_memory", None)
            if shm is not None:
                names.append(shm.name)
        return names


def _unlink_shm(names: list[str]) -> None:
    """Workers are stopped with ``ray.kill`` and never unlink what they created."""
    for name in names:
        try:
            os.unlink(f"/dev/shm/{name.lstrip('/')}")
        except FileNotFoundError:
            pass
