"""Standby worker actors: the next generation's Ray workers, started while this one serves.

Most of an engine start on a warm daemon is a new Ray worker process importing vLLM
(≈ 8 s of 20 on a 2-core machine). A standby worker is that process, created ahead of the
fault by the supervisor (its owner, so it dies with the daemon):

* named exactly as vLLM's executor will name the worker of that rank in the next
  generation (``vllm_Worker_<daemon>-g<N+1>_TP<r>``), in the supervisor's namespace;
* scheduled on the node of the bundle that rank uses in the placement group it is made
  from (node affinity, not the group itself: with replicas, any replica's next build may
  adopt it, and it must not die with one replica's group), holding **no** resources
  (``num_cpus=0``, ``num_gpus=0``): it never takes a bundle from the serving generation,
  touches no device, and on a GPU host holds no device memory;
* with vLLM's worker, model runner and the model's module imported, then idle.

vLLM's ``RayWorkerProc`` already splits its start in two: a light ``__init__`` that keeps
its arguments, and ``initialize_worker`` after the GPU ids are known. A standby is a
``RayWorkerProc`` whose ``__init__`` runs later, in ``adopt``: the next executor
(``SupervisedRayExecutor``) finds it by name where vLLM would create a new actor, hands it
the constructor arguments, and from there vLLM's own steps run unchanged.

On a GPU host, an adopted worker holds no GPU in Ray's accounting: the executor places a
small *bundle claim* actor with the bundle's GPU in it, which holds the resource for the
generation's lifetime and tells the worker which device Ray gave the bundle.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from typing import Any

import ray
from vllm.platforms import current_platform

from executor.ray_v2 import SupervisedRayWorkerProc

# Under vLLM's logger tree: in the engine-core process vLLM's logging config (handler, level,
# the "(EngineCore pid=…)" prefix) applies to these lines too; a logger outside it prints
# warnings only.
logger = logging.getLogger("vllm.supervisor.executor")

class StandbyMismatch(RuntimeError):
    """The standby runs on another node than the bundle the executor gives its rank."""


class StandbyRayWorkerProc(SupervisedRayWorkerProc):
    """A worker actor with vLLM imported and no engine yet."""

    def __init__(self, preload: list[str]):  # noqa: D107 (deferred)
        started = time.monotonic()
        for module in preload:
            importlib.import_module(module)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._claimed_ids: list[str] | None = None
        self._adopted = False
        self._preload_s = time.monotonic() - started

    def standby_info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "preload_s": self._preload_s, "adopted": self._adopted}

    def adopt(self, node_id: str, claimed_ids: list[str] | None, **init_kwargs: Any) -> int:
        """Become the worker vLLM's executor would have created with ``init_kwargs`` on the
        node ``node_id`` (its bundle's)."""
        if self._adopted:
            raise StandbyMismatch("this standby was adopted already")
        if node_id != self._node_id:
            raise StandbyMismatch(f"standby runs on node {self._node_id[:12]}, its rank's bundle is on {node_id[:12]}")
        self._adopted = True
        self._claimed_ids = claimed_ids
        SupervisedRayWorkerProc.__init__(self, **init_kwargs)
        return os.getpid()

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        if self._claimed_ids is None:
            return super().get_node_and_physical_gpu_ids()
        return ray.get_runtime_context().get_node_id(), [
            current_platform.device_control_id_to_physical_device_id(x) for x in self._claimed_ids
        ]


# --- the supervisor's side: creating standbys ------------------------------------------


def _ensure_device_key() -> str:
    if current_platform.is_cpu() and not current_platform.ray_device_key:
        current_platform.ray_device_key = "CPU"
    return current_platform.ray_device_key


def preload_modules(vllm_config: Any) -> list[str]:
    """What a worker imports before it can load the model: the worker class, our executor
    module, and the module of the model's architecture."""
    modules = ["executor.ray_v2", "vllm.v1.executor.multiproc_executor"]
    worker_cls = vllm_config.parallel_config.worker_cls
    if isinstance(worker_cls, str) and "." in worker_cls:
        modules.append(worker_cls.rsplit(".", 1)[0])
    try:
        from vllm.model_executor.models.registry import _VLLM_MODELS

        for arch in vllm_config.model_config.architectures or []:
            if arch in _VLLM_MODELS:
                modules.append(f"vllm.model_executor.models.{_VLLM_MODELS[arch][0]}")
    except Exception:  # an unknown registry layout costs the preload, not the standby
        pass
    return modules


def runtime_env_for(vllm_config: Any) -> dict:
    """The runtime env vLLM's executor gives its worker actors (env vars set at process
    creation must match, so the standby is created with the same)."""
    from executor.ray_v2 import SupervisedRayExecutor

    executor = object.__new__(SupervisedRayExecutor)
    executor.vllm_config = vllm_config
    executor.parallel_config = vllm_config.parallel_config
    return executor._build_runtime_env()


def create_standby_workers(vllm_config: Any, placement_group: Any, instance_id: str, namespace: str) -> list[dict]:
    """Create one standby per rank of the engine ``vllm_config`` describes, on the node of the
    bundle the executor gives that rank in ``placement_group``. Returns ``{"rank", "name",
    "actor_id", "bundle", "node_id"}`` per rank; does not wait for them to finish importing."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from vllm.v1.executor.ray_utils import build_actor_name, get_bundles_sorted_by_node

    _ensure_device_key()
    pc = vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    pcp = getattr(pc, "prefill_context_parallel_size", 1)
    runtime_env = runtime_env_for(vllm_config)
    preload = preload_modules(vllm_config)
    out = []
    for rank, (bundle, node_id, _ip) in enumerate(get_bundles_sorted_by_node(placement_group)[: pc.world_size]):
        name = build_actor_name(instance_id, rank, tp, pp, pcp)
        actor = ray.remote(StandbyRayWorkerProc).options(
            name=name, namespace=namespace, num_cpus=0, num_gpus=0, runtime_env=runtime_env,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(preload)
        out.append({"rank": rank, "name": name, "actor_id": actor._actor_id.hex(), "bundle": bundle,
                    "node_id": node_id, "handle": actor})
    return out


def actor_state(actor_id: str) -> dict:
    """Ray's GCS record of one actor: ``State`` (PENDING_CREATION, ALIVE, DEAD, ...), ``Pid``,
    and the death cause when dead."""
    from ray._private import state

    info = state.actors(actor_id=actor_id) or {}
    death = info.get("DeathCause") or {}
    return {"state": info.get("State", "DEAD"), "pid": info.get("Pid"),
            "death": str(death)[:300] if death else ""}
