"""A standby worker (``executor.standby``) is the worker vLLM's executor would create: it
touches no device before adoption (its preload sees none; one that initialised CUDA is
refused), and it is created with the actor options vLLM gives its own workers, which the
executor checks at adoption (``executor.adoption.option_mismatch``).

vLLM's side is vLLM's own code: ``RayExecutorV2._init_executor`` runs up to the creation of
the first worker actor, with Ray faked, and the options it creates that actor with are the
ones ``SupervisedRayExecutor._adopt_standby`` receives. A real vLLM config of the demo model
(CPU; about 15 s with the imports).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
TP = 2


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """The demo model's config, as the daemon builds it (TP=2, our Ray executor). vLLM's
    config writes variables into the process; they are put back afterwards."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from executor.ray_v2 import SupervisedRayExecutor
    from supervisor.demo_model import build_demo_model

    model = build_demo_model(tmp_path_factory.mktemp("data"))
    saved = dict(os.environ)
    try:
        return AsyncEngineArgs(model=str(model), distributed_executor_backend=SupervisedRayExecutor,
                               tensor_parallel_size=TP, max_model_len=256).create_engine_config()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def standby_module(monkeypatch):
    """``executor.standby`` with Ray's runtime context faked (node ``node-a``), and the
    device variable put back after the test (a standby hides it in this process)."""
    from executor import standby

    monkeypatch.setattr(standby.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-a"))
    monkeypatch.delenv(standby.DEVICES_VAR, raising=False)
    yield standby
    gc.unfreeze()  # a standby froze this process's heap


def vllm_worker_options(vllm_config) -> dict:
    """The options vLLM's ``_init_executor`` creates rank 0's worker actor with, as our
    executor's ``_adopt_standby`` receives them (through ``AdoptingRay``)."""
    import vllm.v1.executor.ray_executor_v2 as v2

    from executor.adoption import AdoptingRay
    from executor.ray_v2 import SupervisedRayExecutor

    class Created(Exception):
        pass

    captured: dict = {}

    def adopt(options: dict, init_kwargs: dict):
        captured.update(options)
        raise Created

    fake_ray = SimpleNamespace(
        remote=lambda cls: SimpleNamespace(options=lambda **options: None),
        get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: "node-a"),
        util=SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"),
    )
    world = vllm_config.parallel_config.world_size
    executor = object.__new__(SupervisedRayExecutor)
    executor.vllm_config, executor.parallel_config = vllm_config, vllm_config.parallel_config
    with mock.patch.object(v2, "ray", AdoptingRay(fake_ray, adopt)), \
            mock.patch.object(v2, "initialize_ray_cluster", lambda *a, **k: None), \
            mock.patch.object(v2, "get_bundles_sorted_by_node",
                              lambda pg: [(i, "node-a", "127.0.0.1") for i in range(world)]), \
            mock.patch.object(v2, "MessageQueue", mock.MagicMock()):
        with pytest.raises(Created):
            v2.RayExecutorV2._init_executor(executor)
    executor._finalizer.detach()
    return captured


# --- Finding 3: no device before adoption -------------------------------------------------


def test_preload_sees_no_device_and_leaves_cuda_uninitialised(vllm_config, tmp_path):
    """The real preload of the demo model's modules, in a process of its own (as in a standby
    actor): every import runs with no device visible, and torch has not initialised CUDA."""
    from executor.standby import preload_modules

    (tmp_path / "standby_probe.py").write_text("import os\nSEEN = os.environ.get('CUDA_VISIBLE_DEVICES')\n")
    modules = preload_modules(vllm_config) + ["standby_probe"]
    script = textwrap.dedent("""
        import gc, json, os, sys
        from types import SimpleNamespace
        from executor import standby
        standby.ray.get_runtime_context = lambda: SimpleNamespace(get_node_id=lambda: "node-a")
        worker = standby.StandbyRayWorkerProc(sys.argv[1:], {})
        import standby_probe, torch
        print(json.dumps({"cuda_initialized": torch.cuda.is_initialized(),
                          "info": worker.standby_info()["cuda_initialized"],
                          # vLLM, torch and the model's module out of the build's collections
                          "frozen": worker.standby_info()["heap_frozen"] > 300_000,
                          "seen_while_importing": standby_probe.SEEN,
                          "after_preload": os.environ.get("CUDA_VISIBLE_DEVICES"),
                          "imported": [m for m in sys.argv[1:] if m in sys.modules]}))
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1", PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    out = subprocess.run([sys.executable, "-c", script, *modules], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "vllm.model_executor.models.llama" in modules
    assert result == {"cuda_initialized": False, "info": False, "frozen": True, "seen_while_importing": "",
                      "after_preload": "", "imported": modules}


def test_standby_that_initialised_cuda_refuses_adoption(standby_module, monkeypatch):
    initialised = []
    monkeypatch.setattr(standby_module, "cuda_initialized", lambda: True)
    monkeypatch.setattr(standby_module.SupervisedRayWorkerProc, "__init__", lambda self, **kw: initialised.append(kw))
    worker = standby_module.StandbyRayWorkerProc([], {})
    assert worker.standby_info()["cuda_initialized"] is True
    with pytest.raises(standby_module.StandbyMismatch, match="CUDA"):
        worker.adopt("node-a", None, rank=0)
    assert initialised == [] and worker.standby_info()["adopted"] is False


def test_standby_that_initialises_cuda_after_its_preload_refuses_adoption(standby_module, monkeypatch):
    initialised = []
    monkeypatch.setattr(standby_module.SupervisedRayWorkerProc, "__init__", lambda self, **kw: initialised.append(kw))
    worker = standby_module.StandbyRayWorkerProc([], {})
    assert worker.standby_info()["cuda_initialized"] is False
    monkeypatch.setattr(standby_module, "cuda_initialized", lambda: True)
    assert worker.standby_info()["cuda_initialized"] is True
    with pytest.raises(standby_module.StandbyMismatch, match="CUDA"):
        worker.adopt("node-a", None, rank=0)
    assert initialised == []


def test_a_standby_whose_cuda_saw_no_device_refuses_adoption(standby_module, monkeypatch):
    """On a GPU, an import that made CUDA initialise while the devices were hidden leaves the
    process without a device for good (CUDA reads the variable once): refused, not adopted."""
    import torch

    initialised = []
    monkeypatch.setattr(standby_module.SupervisedRayWorkerProc, "__init__", lambda self, **kw: initialised.append(kw))
    worker = standby_module.StandbyRayWorkerProc([], {})
    monkeypatch.setattr(standby_module.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(standby_module.StandbyMismatch, match="sees no device"):
        worker.adopt("node-a", None, rank=0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    worker.adopt("node-a", None, rank=0)
    assert initialised == [{"rank": 0}]


@pytest.mark.parametrize("before", [None, "", "3,5"])
def test_adopt_restores_the_devices_exactly_before_vllms_init(standby_module, monkeypatch, before):
    if before is not None:
        monkeypatch.setenv(standby_module.DEVICES_VAR, before)
    seen = []

    def vllm_init(self, **kwargs):
        seen.append((dict(kwargs), standby_module.DEVICES_VAR in os.environ, os.environ.get(standby_module.DEVICES_VAR)))

    monkeypatch.setattr(standby_module.SupervisedRayWorkerProc, "__init__", vllm_init)
    worker = standby_module.StandbyRayWorkerProc([], {})
    assert os.environ[standby_module.DEVICES_VAR] == ""  # hidden while it idles
    assert worker.adopt("node-a", None, rank=1, is_driver_worker=False) == os.getpid()
    assert seen == [({"rank": 1, "is_driver_worker": False}, before is not None, before)]
    assert os.environ.get(standby_module.DEVICES_VAR) == before


def test_cuda_initialized_is_false_without_torch(monkeypatch):
    from executor.standby import cuda_initialized

    monkeypatch.delitem(sys.modules, "torch")
    assert cuda_initialized() is False


# --- Finding 4: the same actor options as vLLM's workers -----------------------------------


@pytest.mark.parametrize("weight_transfer", [None, "sharded_rdt"])
def test_standby_options_are_vllms(vllm_config, monkeypatch, weight_transfer):
    """What the daemon gives the standby equals what vLLM's executor creates its workers with,
    but for the options a standby sets otherwise; a variable vLLM's config wrote into the
    daemon (``VLLM_USE_BREAKABLE_CUDAGRAPH``, on CUDA) is in both."""
    from executor.adoption import OWN_OPTIONS, creation_options, option_mismatch
    from executor.ray_v2 import worker_niceness
    from executor.standby import worker_options

    if weight_transfer:
        from vllm.config import WeightTransferConfig

        monkeypatch.setattr(vllm_config, "weight_transfer_config", WeightTransferConfig(backend=weight_transfer))
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    ours = worker_options(vllm_config)
    theirs = vllm_worker_options(vllm_config)
    assert not set(ours) & OWN_OPTIONS
    assert ours == creation_options(theirs)
    assert option_mismatch(ours, theirs) == []
    assert theirs["runtime_env"]["env_vars"]["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1"
    assert theirs["runtime_env"]["env_vars"]["TORCH_COMPILE_DISABLE"] == "1"  # ours, on CPU
    assert theirs["runtime_env"]["env_vars"]["RAY_worker_niceness"] == worker_niceness()  # ours: not Ray's nice 15
    assert ("enable_tensor_transport" in theirs) == bool(weight_transfer)


def lone_config(tmp_path):
    """The demo model's config with one worker (TP=1), our Ray executor; the process's variables
    put back after vLLM's config wrote some."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from executor.ray_v2 import SupervisedRayExecutor
    from supervisor.demo_model import build_demo_model

    saved = dict(os.environ)
    try:
        return AsyncEngineArgs(model=str(build_demo_model(tmp_path)), distributed_executor_backend=SupervisedRayExecutor,
                               max_model_len=256).create_engine_config()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_with_replicas_a_lone_cpu_worker_is_bound_as_vllms_data_parallel_binds_it(vllm_config, tmp_path, monkeypatch):
    """On CPU with replicas, a worker alone in its engine gets the OpenMP settings vLLM's ``mp``
    executor starts each engine's worker with (as many threads as cores vLLM picks for it, bound
    to them), in the options vLLM's executor creates it with and in the standby's, so the standby
    is still adopted; the daemon's own environment is left as it was. None for one replica (Ray's
    pool, as ``vllm serve`` on Ray runs it), with ``nobind``, and for an engine of two workers
    (vLLM would bind each to a NUMA node of its own)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    from executor.adoption import option_mismatch
    from executor.events import ADDITIONAL_CONFIG_KEY
    from executor.ray_v2 import SupervisedRayExecutor, cpu_binding
    from executor.standby import worker_options
    from supervisor.demo_model import build_demo_model

    lone = lone_config(tmp_path)
    saved = dict(os.environ)
    assert cpu_binding(lone) == {}  # one engine
    lone.additional_config[ADDITIONAL_CONFIG_KEY] = {"replicas": 2}
    cores = OMPProcessManager(lone).cpu_lists[0]
    env = cpu_binding(lone)
    assert dict(os.environ) == saved
    assert env["OMP_NUM_THREADS"] == str(len(cores)) and cores
    bound = env.get("GOMP_CPU_AFFINITY") or env.get("OMP_PLACES") or env.get("KMP_AFFINITY")
    assert bound and all(str(c) in bound for c in cores), env
    ours, theirs = worker_options(lone), vllm_worker_options(lone)
    assert {k: theirs["runtime_env"]["env_vars"].get(k) for k in env} == env
    assert option_mismatch(ours, theirs) == []
    monkeypatch.setitem(vllm_config.additional_config, ADDITIONAL_CONFIG_KEY, {"replicas": 2})
    assert cpu_binding(vllm_config) == {}  # TP=2
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert cpu_binding(lone) == {}


def test_a_list_per_replica_binds_each_replica_to_its_cores_and_the_standby_follows(tmp_path, monkeypatch,
                                                                                    adopting_executor):
    """``VLLM_CPU_OMP_THREADS_BIND=0|1`` with two replicas: replica 0's worker on core 0, replica
    1's on core 1, as ``vllm serve --data-parallel-size 2`` binds its ranks. The one standby is
    made with the replica that came up last's binding; another replica adopts it, bound again to
    its own core (before this, vLLM read every replica as data-parallel rank 0: all on core 0)."""
    from executor.cpu_binding import cores_of
    from executor.events import ADDITIONAL_CONFIG_KEY
    from executor.ray_v2 import cpu_binding
    from executor.standby import worker_options

    executor, install, killed = adopting_executor
    lone = lone_config(tmp_path)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    lone.additional_config[ADDITIONAL_CONFIG_KEY] = {"replicas": 2, "replica": 0}
    first, standby_options = cpu_binding(lone), worker_options(lone)
    lone.additional_config[ADDITIONAL_CONFIG_KEY] = {"replicas": 2, "replica": 1}
    second = cpu_binding(lone)
    assert (cores_of(first), cores_of(second)) == ([0], [1]) and first["OMP_NUM_THREADS"] == "1"
    standby = FakeStandby(standby_options)
    install(standby)
    assert executor._adopt_standby(vllm_worker_options(lone), {"rank": 0}) is standby
    assert standby.bindings == [second] and killed == []
    standby = FakeStandby(worker_options(lone))  # made for replica 1: nothing to change
    install(standby)
    assert executor._adopt_standby(vllm_worker_options(lone), {"rank": 0}) is standby
    assert standby.bindings == [{}]


def test_agent_creates_standbys_with_the_daemons_options(vllm_config, monkeypatch):
    """The agent's own environment does not enter: it creates the actors with the options the
    daemon computed, and hands each standby the same to report at adoption."""
    import vllm.v1.executor.ray_utils as ray_utils

    from executor import standby

    created = []

    def remote(cls):
        return SimpleNamespace(options=lambda **options: SimpleNamespace(
            remote=lambda *args: created.append((options, args)) or SimpleNamespace(_actor_id=bytes([len(created)]))))

    monkeypatch.setattr(standby.ray, "remote", remote)
    monkeypatch.setattr(ray_utils, "get_bundles_sorted_by_node", lambda pg: [(i, f"{i:056x}", "ip") for i in range(TP)])
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    options = {"runtime_env": {"env_vars": {"TORCH_COMPILE_DISABLE": "1", "VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}},
               "enable_tensor_transport": True}
    workers = standby.create_standby_workers(vllm_config, object(), "inst-g2", "ns", options, 3 * 2**30)
    assert [w["rank"] for w in workers] == list(range(TP))
    for (actor_options, args), w in zip(created, workers):
        assert {k: actor_options[k] for k in options} == options
        assert actor_options["name"] == w["name"] and actor_options["namespace"] == "ns"
        assert actor_options["num_cpus"] == 0 and actor_options["num_gpus"] == 0
        assert args == (standby.preload_modules(vllm_config), options, 3 * 2**30)


def test_option_mismatch_names_the_differing_settings():
    from executor.adoption import option_mismatch

    env = {"TORCH_COMPILE_DISABLE": "1", "VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    vllm = {"name": "vllm_Worker_x_TP0", "num_cpus": 0, "num_gpus": 1, "scheduling_strategy": object(),
            "runtime_env": {"env_vars": dict(env), "nsight": {"t": "cuda"}}, "enable_tensor_transport": True}
    standby = {"runtime_env": {"env_vars": dict(env), "nsight": {"t": "cuda"}}, "enable_tensor_transport": True}
    assert option_mismatch(standby, vllm) == []  # name, resources and scheduling may differ
    assert option_mismatch({**standby, "namespace": "ns", "num_gpus": 0}, vllm) == []
    assert option_mismatch({**standby, "runtime_env": {"env_vars": {"TORCH_COMPILE_DISABLE": "1"},
                                                       "nsight": {"t": "cuda"}}}, vllm) == [
        "runtime_env.env_vars.VLLM_USE_BREAKABLE_CUDAGRAPH"]
    assert option_mismatch({**standby, "runtime_env": {"env_vars": {**env, "TORCH_COMPILE_DISABLE": "0"}}}, vllm) == [
        "runtime_env.env_vars.TORCH_COMPILE_DISABLE", "runtime_env.nsight"]
    assert option_mismatch({"runtime_env": standby["runtime_env"]}, vllm) == ["enable_tensor_transport"]


class FakeStandby:
    """A standby actor handle as ``_adopt_standby`` uses it (with Ray's ``get`` the identity)."""

    def __init__(self, created_with: dict, cuda: bool = False):
        self.adopted: list = []
        self.bindings: list = []  # the OpenMP binding each adoption was given (executor.cpu_binding)
        self.standby_info = SimpleNamespace(remote=lambda: {"pid": 4242, "cuda_initialized": cuda,
                                                            "created_with": created_with})
        self.adopt = SimpleNamespace(remote=lambda node, ids, binding=None, **kw: self.bindings.append(binding)
                                     or self.adopted.append((node, ids, kw)) or 4242)


@pytest.fixture
def adopting_executor(monkeypatch, caplog):
    """``SupervisedRayExecutor`` as far as ``_adopt_standby`` needs it, Ray faked: yields the
    executor, a function installing the standby ``get_actor`` finds, and the handles killed.
    Its log goes to ``caplog`` (vLLM's logger tree does not propagate to the root)."""
    import executor.adoption as adoption
    import executor.cluster as cluster
    import executor.ray_v2 as ray_v2

    found: dict = {}
    killed: list = []
    monkeypatch.setattr(ray_v2, "ray", SimpleNamespace(get_actor=lambda name, namespace: found["standby"],
                                                       get=lambda ref: ref))
    monkeypatch.setattr(adoption, "bundle_node", lambda pg, index: "node-a")
    monkeypatch.setattr(adoption, "actor_node", lambda handle: getattr(handle, "node", "node-a"))
    monkeypatch.setattr(cluster, "kill_handles", lambda handles: killed.extend(handles))
    executor = object.__new__(ray_v2.SupervisedRayExecutor)
    executor._standby_namespace, executor.adopted, executor._claims = "ns", {}, []
    ray_v2.logger.addHandler(caplog.handler)
    yield executor, lambda standby: found.update(standby=standby), killed
    ray_v2.logger.removeHandler(caplog.handler)


def test_adoption_guard_accepts_a_standby_created_as_vllms_worker(vllm_config, adopting_executor):
    from executor.standby import worker_options

    executor, install, killed = adopting_executor
    vllm = vllm_worker_options(vllm_config)
    standby = FakeStandby(worker_options(vllm_config))
    install(standby)
    assert executor._adopt_standby(vllm, {"rank": 0}) is standby
    assert standby.adopted == [("node-a", None, {"rank": 0})] and killed == [] and executor.adopted == {0: 4242}


def test_adoption_guard_refuses_a_standby_created_otherwise(vllm_config, adopting_executor, monkeypatch, caplog):
    """A variable vLLM's config wrote into the daemon after the standby was created (as on a
    CUDA host before the fix, when the agent computed the runtime env): not adopted, killed,
    and the log names the variable."""
    from executor.standby import worker_options

    executor, install, killed = adopting_executor
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    standby = FakeStandby(worker_options(vllm_config))
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    install(standby)
    assert executor._adopt_standby(vllm_worker_options(vllm_config), {"rank": 0}) is None
    assert standby.adopted == [] and killed == [standby] and executor.adopted == {}
    assert "runtime_env.env_vars.VLLM_USE_BREAKABLE_CUDAGRAPH" in caplog.text


def test_adoption_guard_refuses_a_standby_that_initialised_cuda(vllm_config, adopting_executor, caplog):
    from executor.standby import worker_options

    executor, install, killed = adopting_executor
    standby = FakeStandby(worker_options(vllm_config), cuda=True)
    install(standby)
    assert executor._adopt_standby(vllm_worker_options(vllm_config), {"rank": 0}) is None
    assert standby.adopted == [] and killed == [standby]
    assert "CUDA" in caplog.text


def test_a_standby_on_another_node_is_refused_without_a_call(vllm_config, adopting_executor, caplog):
    """The standby of a rank whose host was partitioned: Ray's actor table says where it runs,
    and a call to it would wait until Ray marks that host dead (47 s in the real-hosts test
    before this check). Refused at once, killed, the worker created."""
    from executor.standby import worker_options

    executor, install, killed = adopting_executor
    standby = FakeStandby(worker_options(vllm_config))
    standby.node = "node-cut-off"

    def hangs():
        raise AssertionError("the standby was called")

    standby.standby_info = SimpleNamespace(remote=hangs)
    install(standby)
    assert executor._adopt_standby(vllm_worker_options(vllm_config), {"rank": 1}) is None
    assert standby.adopted == [] and killed == [standby] and executor.adopted == {}
    assert "its rank's bundle is on node-a" in caplog.text


def test_workers_start_at_the_operators_niceness_else_at_the_servers(monkeypatch):
    """Ray starts its workers at nice 15; the daemon's start at 0 (as vLLM's ``mp`` workers do)
    unless the operator exported ``RAY_worker_niceness``."""
    from executor.ray_v2 import worker_niceness

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    assert worker_niceness() == "0"
    monkeypatch.setenv("RAY_worker_niceness", "15")
    assert worker_niceness() == "15"
    monkeypatch.setenv("RAY_worker_niceness", " ")
    assert worker_niceness() == "0"


def test_each_standby_worker_reserves_the_kv_size_its_engine_allocates(monkeypatch):
    """On CPU, the explicit KV size (``VLLM_CPU_KVCACHE_SPACE``, which the daemon always sets)
    that each worker's KV cache takes; none when vLLM sizes it from free memory itself, and
    none on a GPU (its KV cache is device memory)."""
    from executor import standby

    monkeypatch.setattr(standby.current_platform, "is_cpu", lambda: True)

    def config(nbytes):
        return SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=nbytes))

    assert standby.kv_reserve_bytes(config(3 * 2**30)) == 3 * 2**30
    assert standby.kv_reserve_bytes(config(None)) == 0
    monkeypatch.setattr(standby.current_platform, "is_cpu", lambda: False)
    assert standby.kv_reserve_bytes(config(3 * 2**30)) == 0


# --- parked while idle ------------------------------------------------------------------------


@pytest.fixture
def parked_standby(standby_module, monkeypatch):
    """A standby worker (no Ray: its node address is loopback, its park's re-submission recorded)."""
    monkeypatch.setattr(standby_module.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(standby_module.SupervisedRayWorkerProc, "__init__", lambda self, **kw: None)
    worker = standby_module.StandbyRayWorkerProc([], {})
    worker.again = []
    worker._park_again = worker.again.append
    yield worker
    if worker._waker is not None:
        worker._waker.close()


def park_on_a_thread(worker, wait_s: float):
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(worker.park(wait_s)), daemon=True)
    thread.start()
    return thread, result


def test_a_parked_standby_sleeps_until_one_connection_wakes_it(parked_standby):
    import socket

    address = parked_standby.wake_address()
    assert address[0] == "127.0.0.1" and parked_standby.wake_address() == address  # opened once
    thread, result = park_on_a_thread(parked_standby, 60.0)
    thread.join(0.5)
    assert thread.is_alive() and result == []  # parked
    socket.create_connection(address, timeout=1).close()  # StandbyWorkers.wake
    thread.join(10)
    assert result == ["woken"] and parked_standby.again == []
    assert parked_standby.standby_info()["parking"] == {"parks": 1, "woken_by": "a connection"}
    # woken for good: a park queued behind it returns at once, and the socket is closed
    assert parked_standby.park(60.0) == "awake"
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1)


def test_a_wake_up_before_the_park_starts_is_not_lost(parked_standby):
    import socket

    address = parked_standby.wake_address()
    socket.create_connection(address, timeout=1).close()  # the claim's connection came first
    assert parked_standby.park(60.0) == "woken"


def test_a_park_nobody_ends_parks_again_behind_the_calls_that_came(parked_standby):
    parked_standby.wake_address()
    assert parked_standby.park(0.05) == "again" and parked_standby.again == [0.05]


@pytest.mark.parametrize("call", ["standby_info", "adopt"])
def test_any_call_that_reaches_a_parked_standby_ends_its_parking(parked_standby, call):
    """A build that calls a standby nobody woke waits for the park it queued behind (at most
    PARK_S), and then no more: the park re-submitted behind its call returns at once."""
    import socket

    address = parked_standby.wake_address()
    assert parked_standby.park(0.01) == "again"  # parked once, nobody woke it
    if call == "standby_info":
        parked_standby.standby_info()
    else:
        parked_standby.adopt("node-a", None, rank=0)
    assert parked_standby.park(60.0) == "awake" and parked_standby.again == [0.01]
    assert parked_standby.standby_info()["parking"] == {"parks": 1, "woken_by": call}
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1)


def test_a_standby_never_asked_for_its_address_does_not_park(parked_standby):
    assert parked_standby.park(60.0) == "awake"
