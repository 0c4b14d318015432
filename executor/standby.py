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
* with vLLM's worker, model runner and the model's module imported and frozen out of the
  garbage collector's walks (``gc.freeze``: the build's collections skip them), then idle; while it
  imports and idles it sees no device (``CUDA_VISIBLE_DEVICES=""``): a CUDA call in an
  import would otherwise create a context on GPU 0 in every standby, kept by the adopted
  worker. ``adopt`` puts the variable back as the process had it before vLLM's ``__init__``
  runs (vLLM's workers run with Ray's ``NOSET_CUDA_VISIBLE_DEVICES`` and never set it; Ray
  sets nothing for an actor holding no GPU). A standby in which torch initialised CUDA
  anyway says so (``standby_info``) and refuses adoption;
* parked once ready (``park``, a task that sleeps on a socket of its own): an idle actor's
  main thread otherwise wakes 100 times a second in Ray's task loop; the daemon's claim wakes
  it with one connection before the build calls it;
* with the actor options vLLM's executor gives its workers (the runtime env above all: it
  takes effect when the process starts), computed by ``worker_options`` in the daemon,
  whose environment the next engine core starts with (the Ray agent that creates the
  actor started before vLLM's config wrote its variables). The executor compares them with
  its own at adoption (``executor.adoption.option_mismatch``) and creates the worker cold
  when they differ.

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

import gc
import importlib
import logging
import os
import select
import socket
import sys
import time
from typing import Any

import ray
from vllm.platforms import current_platform

from executor import cpu_binding, kv_reserve
from executor.ray_v2 import SupervisedRayWorkerProc

# Under vLLM's logger tree: in the engine-core process vLLM's logging config (handler, level,
# the "(EngineCore pid=…)" prefix) applies to these lines too; a logger outside it prints
# warnings only.
logger = logging.getLogger("vllm.supervisor.executor")

# How long a parked standby waits for its wake-up before it parks again (``park``): the longest a
# call that reached it without a wake-up waits.
PARK_S = 2.0

# The devices a standby does not see until adopted (CUDA's runtime and ROCm's HIP both read it).
DEVICES_VAR = "CUDA_VISIBLE_DEVICES"
NVML_CHECK_VAR = "PYTORCH_NVML_BASED_CUDA_CHECK"


class StandbyMismatch(RuntimeError):
    """The standby cannot stand for the worker the executor would create: it runs on another
    node than the rank's bundle, was adopted already, or initialised CUDA."""


def devices_unseen() -> bool:
    """On a GPU platform: whether this process's CUDA sees no device. CUDA reads
    ``CUDA_VISIBLE_DEVICES`` once, when it initialises (``torch.cuda.is_available()`` alone does
    that without NVML's check), and torch caches the count: a standby in which an import did so
    while the devices were hidden can never see one, whatever ``adopt`` restores."""
    torch = sys.modules.get("torch")
    return torch is not None and not current_platform.is_cpu() and torch.cuda.device_count() == 0


def cuda_initialized() -> bool:
    """Whether torch initialised CUDA in this process (torch not imported: it did not)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


class StandbyRayWorkerProc(SupervisedRayWorkerProc):
    """A worker actor with vLLM imported, no device visible and no engine yet."""

    def __init__(self, preload: list[str], created_with: dict, kv_bytes: int = 0):  # noqa: D107 (deferred)
        started = time.monotonic()
        # None: unset; ``adopt`` restores exactly these. NVML's check keeps torch.cuda.is_available()
        # from initialising CUDA (vLLM sets it in its workers too).
        self._saved_env = {k: os.environ.get(k) for k in (DEVICES_VAR, NVML_CHECK_VAR)}
        os.environ[DEVICES_VAR] = ""
        os.environ[NVML_CHECK_VAR] = "1"
        for module in preload:
            importlib.import_module(module)
        # The adopted worker's build collects fully 3-4 times (model load, warm-up, vLLM's
        # freeze_gc_heap), each walking every object the process holds: ~670,000 with vLLM,
        # torch and the model's module imported, 0.4 s per walk on 2 cores. Frozen, the imports
        # are never walked again (they live as long as the process anyway): the build's
        # collections see only what the build made.
        gc.collect()
        gc.freeze()
        self._heap_frozen = gc.get_freeze_count()
        # The KV cache's memory, faulted in and zeroed now rather than on the recovery's path;
        # after the freeze: the collector never walks a tensor's memory anyway.
        self._kv_reserve = kv_reserve.reserve(kv_bytes)
        self._cuda = cuda_initialized()
        if self._cuda:
            logger.error("standby worker (pid %d) initialised CUDA while importing %s: it holds a "
                         "context on a GPU and will not be adopted", os.getpid(), preload)
        self._created_with = created_with  # the actor options it was created with (worker_options)
        self._node_id = ray.get_runtime_context().get_node_id()
        self._claimed_ids: list[str] | None = None
        self._adopted = False
        self._waker: socket.socket | None = None  # parked: the socket one connection wakes it by
        self._awake = False  # woken, or called for anything but park: parks no more
        self._parks = 0  # park calls that waited
        self._woken_by = ""  # what ended the parking ("a connection": the daemon's wake-up)
        self._preload_s = time.monotonic() - started

    # --- parked while idle ------------------------------------------------------------------
    #
    # An idle actor's main thread waits in Ray's task loop, which checks for Python signals every
    # 10 ms (``CoreWorker.CheckSignal``, hard-coded): 100 wake-ups a second, two thirds of an idle
    # standby's, for nothing. While a task runs, that loop does not: ``park`` is a task that
    # waits on a socket, so the standby's main thread sleeps until one connection (the daemon's
    # ``wake``, when it claims the standby) or ``PARK_S``, whichever comes first. Calls that reach
    # the standby meanwhile queue behind the park; any of them ends the parking for good, so a
    # call that came without a wake-up waits at most ``PARK_S``.

    def wake_address(self) -> tuple[str, int]:
        """The address a connection to which ends ``park``: a listening TCP socket on the node's
        own address (where Ray's own ports listen), opened once."""
        if self._waker is None:
            ip = ray.util.get_node_ip_address()
            self._waker = socket.create_server((ip, 0), family=socket.AF_INET6 if ":" in ip else socket.AF_INET,
                                               backlog=8)
        return self._waker.getsockname()[:2]

    # No task events: a park every ``PARK_S`` would otherwise put 1,800 task records an hour per
    # worker into the GCS's task table (kept up to Ray's ``task_events_max_num_task_in_gcs``,
    # 100,000, oldest dropped first), crowding the operator's own tasks out of ``ray list tasks``.
    @ray.method(enable_task_events=False)
    def park(self, wait_s: float = PARK_S) -> str:
        """Wait for a wake-up (a connection to ``wake_address``) for up to ``wait_s``, then park
        again (a call of this actor's own, queued behind whatever came meanwhile) unless woken.
        Returns what ended it: "woken", "again", or "awake" (woken before, or called since)."""
        if self._awake or self._waker is None:  # adopt, as any call, woke it for good
            return "awake"
        self._parks += 1
        readable, _, _ = select.select([self._waker], [], [], wait_s)
        if readable:
            self._wake_up("a connection")
            return "woken"
        self._park_again(wait_s)
        return "again"

    def _park_again(self, wait_s: float) -> None:
        ray.get_runtime_context().current_actor.park.remote(wait_s)

    def _wake_up(self, by: str) -> None:
        """Parks no more: the waker's connections taken and the socket closed; ``by``: what
        ended the parking, kept the first time (``standby_info``'s ``parking``)."""
        if not self._awake and self._parks:
            self._woken_by = by
        self._awake = True
        waker, self._waker = self._waker, None
        if waker is None:
            return
        try:
            waker.setblocking(False)
            while True:
                waker.accept()[0].close()
        except OSError:  # BlockingIOError: none left
            pass
        waker.close()

    def standby_info(self) -> dict[str, Any]:
        self._wake_up("standby_info")
        return {"pid": os.getpid(), "preload_s": self._preload_s, "adopted": self._adopted, "heap_frozen": self._heap_frozen,
                "cuda_initialized": self._cuda or cuda_initialized(), "created_with": self._created_with,
                "parking": {"parks": self._parks, "woken_by": self._woken_by}}

    def adopt(self, node_id: str, claimed_ids: list[str] | None, binding: dict[str, str] | None = None,
              **init_kwargs: Any) -> int:
        """Become the worker vLLM's executor would have created with ``init_kwargs`` on the
        node ``node_id`` (its bundle's), with the devices visible as before the preload, and
        its threads bound to ``binding``'s cores when given (``executor.cpu_binding.rebind``)."""
        self._wake_up("adopt")
        if self._adopted:
            raise StandbyMismatch("this standby was adopted already")
        if node_id != self._node_id:
            raise StandbyMismatch(f"standby runs on node {self._node_id[:12]}, its rank's bundle is on {node_id[:12]}")
        if self._cuda or cuda_initialized():
            logger.error("standby worker (pid %d) initialised CUDA before adoption: refusing it", os.getpid())
            raise StandbyMismatch("the standby initialised CUDA before adoption")
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if devices_unseen():
            logger.error("standby worker (pid %d) initialised CUDA while its devices were hidden: refusing it", os.getpid())
            raise StandbyMismatch("the standby's CUDA sees no device (initialised while they were hidden)")
        self._adopted = True
        self._claimed_ids = claimed_ids
        if binding:
            created = (self._created_with.get("runtime_env") or {}).get("env_vars") or {}
            moved = cpu_binding.rebind(created, binding)
            logger.info("standby worker (pid %d) bound from cores %s to %s (%d threads)", os.getpid(),
                        cpu_binding.cores_of(created), cpu_binding.cores_of(binding), moved)
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
    """vLLM's CPU platform has no Ray device key; its Ray code reads it from the platform object
    each of its modules bound at import. On the class too: a process that imported vLLM on two
    threads at once may hold two such objects (``executor.rayagent``'s docstring)."""
    if current_platform.is_cpu() and not current_platform.ray_device_key:
        current_platform.ray_device_key = type(current_platform).ray_device_key = "CPU"
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


def worker_options(vllm_config: Any) -> dict:
    """The actor options vLLM's executor (``RayExecutorV2._init_executor``, step 4) gives its
    workers for ``vllm_config``, but for those a standby sets otherwise
    (``executor.adoption.OWN_OPTIONS``). vLLM reads variables of the process it runs in
    (``VLLM_USE_BREAKABLE_CUDAGRAPH``, which its config sets): call it in the process whose
    environment the engine core gets, the daemon, not the Ray agent."""
    from executor.ray_v2 import SupervisedRayExecutor

    executor = object.__new__(SupervisedRayExecutor)
    executor.vllm_config = vllm_config
    executor.parallel_config = vllm_config.parallel_config
    options: dict[str, Any] = {"runtime_env": executor._build_runtime_env()}
    wt_cfg = getattr(vllm_config, "weight_transfer_config", None)
    if wt_cfg is not None and wt_cfg.backend == "sharded_rdt":
        options["enable_tensor_transport"] = True
    return options


def kv_reserve_bytes(vllm_config: Any) -> int:
    """The KV memory a standby worker reserves (``executor.kv_reserve``): on a CPU host, the
    explicit KV size each worker allocates (``VLLM_CPU_KVCACHE_SPACE``); elsewhere none."""
    if not current_platform.is_cpu():
        return 0
    return int(getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None) or 0)


def create_standby_workers(vllm_config: Any, placement_group: Any, instance_id: str, namespace: str,
                           options: dict, kv_bytes: int = 0) -> list[dict]:
    """Create one standby per rank of the engine ``vllm_config`` describes, on the node of the
    bundle the executor gives that rank in ``placement_group``, with ``options`` (the daemon's
    ``worker_options``), each reserving ``kv_bytes`` of KV memory (``kv_reserve_bytes``).
    Returns ``{"rank", "name", "actor_id", "bundle", "node_id"}`` per rank; does not wait for
    them to finish importing."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from vllm.v1.executor.ray_utils import build_actor_name, get_bundles_sorted_by_node

    _ensure_device_key()
    pc = vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    pcp = getattr(pc, "prefill_context_parallel_size", 1)
    preload = preload_modules(vllm_config)
    out = []
    for rank, (bundle, node_id, _ip) in enumerate(get_bundles_sorted_by_node(placement_group)[: pc.world_size]):
        name = build_actor_name(instance_id, rank, tp, pp, pcp)
        actor = ray.remote(StandbyRayWorkerProc).options(
            name=name, namespace=namespace, num_cpus=0, num_gpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False), **options,
        ).remote(preload, options, kv_bytes)
        out.append({"rank": rank, "name": name, "actor_id": actor._actor_id.hex(), "bundle": bundle,
                    "node_id": node_id, "handle": actor})
    return out


def actor_state(actor_id: str) -> dict:
    """Ray's GCS record of one actor: ``State`` (PENDING_CREATION, ALIVE, DEAD, ...), ``Pid``,
    the death cause when dead, and whether it runs on its owner's node (``local``: for the
    standby's workers, whose owner is the daemon's Ray agent, the daemon's host, where its
    ``Pid`` names the process)."""
    from ray._private import state

    info = state.actors(actor_id=actor_id) or {}
    death = info.get("DeathCause") or {}
    node, owner = (info.get(k, {}).get("NodeID") for k in ("Address", "OwnerAddress"))
    return {"state": info.get("State", "DEAD"), "pid": info.get("Pid"),
            "death": str(death)[:300] if death else "", "local": bool(node) and node == owner}
