"""``SupervisedCompiledGraphExecutor``: vLLM's older Ray executor (``RayDistributedExecutor``,
workers driven through a Ray Compiled Graph) with CPU support, generation-named actors and a
liveness watcher. Selected the way vLLM selects it: the ``ray`` backend with
``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``.

Runs inside vLLM's engine-core process. That executor has no failure-callback slot and no
monitor thread: a dead actor surfaces as ``ActorDiedError`` out of the compiled graph on the
next step, and the engine core dies (measured: the client's stream gets ``EngineDeadError``
20 ms after a ``ray.kill``). So, beside the parent:

* CPU platform: ``ray_device_key = "CPU"``; the actors ask for no ``resources={"CPU": …}``
  (Ray refuses that key; the placement-group bundle holds the core); the worker reports no
  accelerator ids; with replicas, a lone worker starts with vLLM's OpenMP binding
  (``executor.cpu_binding``). On CUDA nothing changes.
* Names: the actors vLLM creates get the names the V2 executor gives its workers,
  ``vllm_Worker_<instance id>[_TP<r>][_PP<r>]`` (the generation is in the instance id, by the
  rank they were created with), so that the supervisor's teardown and tools find them.
* Liveness: a thread polls the workers in Ray's GCS actor table every ``WATCH_S``; the first
  one found dead becomes a ``WorkerDeathEvent`` (rank, actor name, node, Ray's death cause).
  The compiled graph usually notices first (its step raises ``ActorDiedError`` ≈ 20 ms after
  a kill): that step (with PP, its future's ``result()``) reports the dead workers before the
  engine core dies of it.
* The graph is compiled at the end of the build, not on the first step.
* PP on the CPU build: a later stage's intermediate-tensor buffers are allocated on its first
  step (vLLM allocates them in a dummy run the CPU build does not make).

Cost: Ray's compiled-graph channels busy-poll, so each worker holds a core even while idle
(``bench.executor_idle``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import ray
import vllm.v1.executor.ray_executor as _cg
from vllm.platforms import current_platform
from vllm.v1.executor.ray_utils import RayWorkerWrapper, build_actor_name

from executor.reporting import CAUSE_MAX_CHARS, DeathReporter
from executor import canary, history, resume, testhooks
from executor.ray_v2 import set_worker_env

logger = logging.getLogger("vllm.supervisor.executor")

WATCH_S = 0.05  # how often the workers' liveness is read from the GCS actor table


class CpuRayWorkerWrapper(RayWorkerWrapper):
    """The worker actor. On CPU, Ray assigns no accelerator ids. A continued request's past
    counts in its sampler (``executor.history``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        history.install()
        super().__init__(*args, **kwargs)

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        if current_platform.is_cpu():
            return ray.get_runtime_context().get_node_id(), []
        return super().get_node_and_physical_gpu_ids()

    def execute_model_ray(self, execute_model_input: tuple) -> Any:
        # A later pipeline stage copies its input into the model runner's intermediate-tensor
        # buffers, which vLLM allocates in a dummy run (profiling, warm-up) that the CPU build
        # never makes: its first step failed `assert self.intermediate_tensors is not None`.
        # Allocate them as that dummy run does (gpu_model_runner._dummy_run).
        runner = self.worker.model_runner if self.worker is not None else None
        if runner is not None and getattr(runner, "intermediate_tensors", 0) is None and len(execute_model_input) == 3:
            runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
        return super().execute_model_ray(execute_model_input)


class _NamingRay:
    """Stands in for the executor module's ``ray`` while it creates the workers: each
    ``ray.remote(...)(cls).remote(rpc_rank=r)`` gets the actor name of rank ``r``."""

    def __init__(self, real: Any, name_of: Any, cpu: bool, vllm_config: Any):
        self._real, self._name_of, self._cpu, self._vllm_config = real, name_of, cpu, vllm_config
        self.created: dict[str, tuple[int, str]] = {}  # actor id -> (rank, name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real, attr)

    def remote(self, *args: Any, **options: Any) -> Any:
        if args:  # the bare decorator form: not used by the executor
            return self._real.remote(*args, **options)
        set_worker_env(options.setdefault("runtime_env", {}).setdefault("env_vars", {}), self._vllm_config)
        if self._cpu:
            options.pop("resources", None)
        decorate = self._real.remote(**options)
        naming = self

        def wrap(cls: Any) -> Any:
            actor_class = decorate(cls)

            class Named:
                @staticmethod
                def remote(*a: Any, rpc_rank: int, **kw: Any) -> Any:
                    name = naming._name_of(rpc_rank)
                    handle = actor_class.options(name=name).remote(*a, rpc_rank=rpc_rank, **kw)
                    naming.created[handle._actor_id.hex()] = (rpc_rank, name)
                    return handle

            return Named()

        return wrap


class SupervisedCompiledGraphExecutor(DeathReporter, _cg.RayDistributedExecutor):
    """Compiled-graph Ray executor that reports worker deaths to the vllm-supervisor daemon."""

    def _init_executor(self) -> None:
        self._wire()
        resume.install()  # continued requests' grammars start where they stopped
        self._hooks = testhooks.enabled()  # False in production
        self._instance_id = self.vllm_config.instance_id
        cpu = current_platform.is_cpu()
        if cpu:
            current_platform.ray_device_key = "CPU"
        _cg.RayWorkerWrapper = CpuRayWorkerWrapper
        p = self.parallel_config
        real = _cg.ray
        naming = _NamingRay(real, lambda r: build_actor_name(self._instance_id, r, p.tensor_parallel_size,
                                                             p.pipeline_parallel_size, 1), cpu, self.vllm_config)
        _cg.ray = naming
        try:
            super()._init_executor()
        finally:
            _cg.ray = real
        self._watched = dict(naming.created)
        self._stop_watch = threading.Event()
        threading.Thread(target=self._watch, name="CompiledGraphWorkerWatch", daemon=True).start()
        logger.info("generation %d: %d compiled-graph worker actor(s) up: %s", self._generation,
                    len(self._watched), sorted(name for _, name in self._watched.values()))

    def compile_or_warm_up_model(self) -> Any:
        """After the workers' warm-up, compile the graph now rather than on the first step (vLLM's
        default): a compile on the first request stalls it for seconds on a cold host, long enough
        for the supervisor's hang detector to call a healthy engine hung."""
        result = super().compile_or_warm_up_model()
        if self.forward_dag is None:
            started = time.monotonic()
            self.forward_dag = self._compiled_ray_dag(enable_asyncio=False)
            logger.info("generation %d: compiled graph built in %.2f s", self._generation, time.monotonic() - started)
        return result

    _hooks = False
    _last_step_serving = False  # test hook: the last step carried a client request (not only canaries)

    def _execute_dag(self, *args: Any, **kwargs: Any) -> Any:
        if self._hooks:
            serving = canary.step_serves_clients(args[0] if args else kwargs.get("scheduler_output"))
            if serving is not None:
                self._last_step_serving = serving
        try:
            out = super()._execute_dag(*args, **kwargs)
        except Exception as exc:
            self._report_failure(exc)
            raise
        if isinstance(out, Future):
            # With PP the step returns a future: the ActorDiedError comes out of its result()
            # in the engine core's loop, which then dies. Report from there too.
            result = out.result

            def checked(timeout: float | None = None) -> Any:
                try:
                    return result(timeout)
                except Exception as exc:
                    self._report_failure(exc)
                    raise

            out.result = checked
        return out

    def _report_failure(self, exc: BaseException) -> None:
        """A step failed: report the workers that died (from Ray's actor table, else the
        actor the error names) before the engine core dies of it."""
        if self._reported:
            return
        if self._hooks and not self._last_step_serving:
            # Test hook: a canary's step found the death; the poller reports it first.
            deadline = time.monotonic() + testhooks.IDLE_STEP_REPORT_HOLD_S
            while not self._reported and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._reported:
                return
        dead = self._dead_workers()
        watched = getattr(self, "_watched", {})
        if not dead and getattr(exc, "actor_id", None) in watched:
            rank, name = watched[exc.actor_id]
            dead = [(rank, name, "", f"{type(exc).__name__}: {exc}"[:CAUSE_MAX_CHARS])]
        if dead:
            self._record_death(dead)

    def _watch(self) -> None:
        while not self._stop_watch.wait(WATCH_S):
            if self._hooks and self._last_step_serving:
                continue  # test hook: while serving, only a failed step (or its future) reports
            if dead := self._dead_workers():
                if not self._reported:
                    logger.warning("generation %d: the GCS actor-table poller found worker rank(s) %s dead",
                                   self._generation, [d[0] for d in dead])
                self._record_death(dead)
                return

    def _dead_workers(self) -> list:
        from ray._private import state

        dead = []
        for actor_id, (rank, name) in getattr(self, "_watched", {}).items():
            try:
                info = state.actors(actor_id=actor_id)
            except Exception:  # the GCS unreachable: the supervisor's cluster watch sees that
                continue
            if info.get("State") == "DEAD":
                cause = str(info.get("DeathCause") or "actor dead")[:CAUSE_MAX_CHARS]
                dead.append((rank, name, (info.get("Address") or {}).get("NodeID", ""), cause))
        return dead

    def shutdown(self) -> None:
        stop = getattr(self, "_stop_watch", None)
        if stop is not None and not stop.is_set():
            stop.set()
            # The compiled graph's ActorDiedError often kills the engine core (which shuts this
            # executor down) before the next poll: look once more while the workers are as
            # the failure left them (the parent's shutdown kills the rest).
            held = self._hooks and self._last_step_serving  # test hook: the step's report only
            if not self._reported and not held and (dead := self._dead_workers()):
                self._record_death(dead)
        super().shutdown()
