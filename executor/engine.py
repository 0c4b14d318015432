"""Building and tearing down vLLM's ``AsyncLLM`` on our placement group and executor.

Blocking: the supervisor calls these from worker threads.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Callable

from executor import forkserver
from executor.events import ADDITIONAL_CONFIG_KEY


@dataclass
class EngineSpec:
    """Everything needed to build one engine generation."""

    args: Any  # vLLM's serve Namespace (``vllm serve`` flags), model already resolved
    generation: int
    instance_id: str  # carried into the worker actor names
    event_endpoint: str
    placement_group: Any
    kv_cache_space_gib: int = 1  # CPU only (VLLM_CPU_KVCACHE_SPACE)
    standby_namespace: str | None = None  # adopt standby workers from this Ray namespace
    # Without standby workers (Ray V2 executor only): starts this build's own workers as standbys
    # once its config is made, so that their import runs beside the engine core's; returns the
    # namespace to adopt them from (None: vLLM creates them, after the engine core's import).
    start_workers: Callable[[Any], str | None] | None = None
    use_forkserver: bool = False  # fork the engine core from the preloaded fork server
    step_clock: Any = None  # executor.steps.StepClock: stamped at every engine step
    metrics_logger: Any = None  # with replicas: executor.replica_metrics' stand-in for vLLM's Prometheus logger
    replicas: int = 1  # the daemon's engines serving side by side (executor.cpu_binding)
    replica: int = 0  # which of them this engine is


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def uses_compiled_graph() -> bool:
    """vLLM's older compiled-graph Ray executor, selected as vLLM selects it."""
    return os.environ.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1").strip().lower() in ("0", "false")


STARTUP_PLAN_VAR = "VLLM_ENABLE_STARTUP_PLAN"


def set_engine_environment(kv_cache_space_gib: int) -> None:
    """What every engine the daemon builds reads from the environment, where the operator set
    nothing (the engine core and, through vLLM's executor, its workers inherit it):

    * CPU: the KV cache size per worker (``VLLM_CPU_KVCACHE_SPACE``), explicit, so vLLM
      never profiles memory there;
    * GPU: vLLM's startup plan (``VLLM_ENABLE_STARTUP_PLAN=1``,
      ``vllm/v1/worker/startup_plan.py``): each worker keeps the KV memory its first
      profiling found under ``VLLM_CACHE_ROOT``, and the next build of the same
      configuration on the same device (a recovery, a replica, the next start) applies it
      and skips the memory measurement and the CUDA-graph memory estimate. vLLM checks the
      fingerprint and that the device has at least the free memory recorded, else it
      profiles as before. Designed for GPU hosts and not run here (the CPU worker never
      reads it). ``VLLM_ENABLE_STARTUP_PLAN=0`` turns it off."""
    if is_cpu_platform() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gib)
    os.environ.setdefault(STARTUP_PLAN_VAR, "1")


def build_engine(spec: EngineSpec):
    """Create the ``AsyncLLM`` (engine-core subprocess + Ray worker actors) from the same
    flags ``vllm serve`` reads, with our executor subclass; blocks until up."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    adopts = False  # the Ray V2 executor alone adopts standby workers
    if spec.args.distributed_executor_backend == "mp":
        from executor.mp import SupervisedMultiprocExecutor as executor_class
    elif uses_compiled_graph():
        from executor.ray_cgraph import SupervisedCompiledGraphExecutor as executor_class
    else:
        from executor.ray_v2 import SupervisedRayExecutor as executor_class

        adopts = True

    set_engine_environment(spec.kv_cache_space_gib)
    engine_args = AsyncEngineArgs.from_cli_args(spec.args)
    engine_args.distributed_executor_backend = executor_class
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    if spec.placement_group is not None:
        vllm_config.parallel_config.placement_group = spec.placement_group
    vllm_config.instance_id = spec.instance_id
    wiring = vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = {
        "generation": spec.generation,
        "event_endpoint": spec.event_endpoint,
        "replicas": spec.replicas,  # before the workers' options are made from it (start_workers)
        "replica": spec.replica,
    }
    namespace = spec.standby_namespace
    if namespace is None and adopts and spec.start_workers is not None:
        namespace = spec.start_workers(vllm_config)
    wiring["standby_namespace"] = namespace
    # numactl binding replaces the spawn executable: only vLLM's own start method does that.
    use_forkserver = spec.use_forkserver and not vllm_config.parallel_config.numa_bind
    with forkserver.engine_core_start_method(use_forkserver):
        return AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=engine_args.disable_log_stats,
            stat_loggers=[f for f in (spec.step_clock and spec.step_clock.factory(), spec.metrics_logger) if f] or None,
        )


def frontend_for(vllm_config: Any) -> tuple[Any, Any]:
    """A renderer and input processor as ``AsyncLLM`` makes them, owned by the supervisor's
    request path: they live as long as the daemon, not as long as one engine."""
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.input_processor import InputProcessor

    renderer = renderer_from_config(vllm_config)
    return renderer, InputProcessor(vllm_config, renderer)


def wake_streams_dead(engine) -> bool:
    """Wake every ``generate`` of ``engine`` that waits for an output, with vLLM's own
    ``EngineDeadError``, as its output handler does when the engine core dies
    (``OutputProcessor.propagate_error``): that error ends a stream without vLLM's abort of
    the request, which a dead engine may never answer. False when the engine has no output
    processor (nothing was woken)."""
    processor = getattr(engine, "output_processor", None)
    if processor is None:
        return False
    from vllm.v1.engine.exceptions import EngineDeadError

    processor.propagate_error(EngineDeadError("the engine generation was taken down by the supervisor"))
    return True


def engine_core_pids(engine) -> list[int]:
    """PIDs of the engine's engine-core process(es)."""
    core = getattr(engine, "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    procs = getattr(manager, "processes", None) or []
    return [p.pid for p in procs if getattr(p, "pid", None)]


def shutdown_engine(engine, timeout_s: float = 5.0) -> None:
    """Shut the engine down without waiting for a dead engine core to exit by itself."""
    engine.shutdown(timeout=timeout_s)


def child_pids(parents: set[int], cmd_prefix: bytes = b"") -> list[int]:
    """Live children of ``parents`` whose command line starts with ``cmd_prefix``."""
    from executor.procfs import children

    return children(parents, cmd_prefix)


def engine_cores_under(root: int) -> set[int]:
    """The live engine-core processes among ``root``'s descendants (vLLM's own, or the fork
    server's children), by the process title vLLM gives them (``set_process_title``:
    ``{VLLM_PROCESS_NAME_PREFIX}::EngineCore``)."""
    from vllm import envs

    from executor.procfs import read
    from executor.reaper import descendants

    title = f"{envs.VLLM_PROCESS_NAME_PREFIX}::EngineCore".encode()
    return {pid for pid, _ in descendants(root) if (read(pid, "cmdline") or b"").startswith(title)}


def with_descendants(pids: set[int]) -> list[int]:
    """``pids`` and every live descendant of theirs (an ``mp`` engine core's workers), listed
    before they are killed: a worker still starting does not watch its parent yet."""
    from executor.reaper import descendants

    return sorted(pids | {pid for root in pids for pid, _ in descendants(root)})


def engine_worker_pids(engine) -> list[int]:
    """PIDs of the engine core's child processes (the ``mp`` executor's workers)."""
    return child_pids(set(engine_core_pids(engine)))


def kill_pids(pids: list[int]) -> list[int]:
    """SIGKILL each process still alive (works on stopped, hung ones too); returns those hit."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def kill_engine_workers(engine) -> list[int]:
    """SIGKILL the engine core's worker processes."""
    return kill_pids(engine_worker_pids(engine))


def new_detokenizer(tokenizer: Any, prompt_token_ids: list[int], params: Any, request_id: str) -> Any:
    """vLLM's incremental detokenizer for a request, as the engine's output processor builds
    it (same class, same tokenizer): the supervisor drives one across a seam."""
    from types import SimpleNamespace

    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    request = SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                              prompt_embeds=None, sampling_params=params)
    return IncrementalDetokenizer.from_new_request(tokenizer, request)


def logprob_token_strings(tokenizer: Any, token_ids: list[int], context_ids: list[int]) -> list[str]:
    """The token strings vLLM's output processor gives one position's logprobs (the sampled
    token and its alternatives, ``token_ids``) after the sampled tokens ``context_ids``: each
    id on its own, a byte-fallback piece completed with up to four preceding sampled tokens
    (``LogprobsProcessor._update_sample_logprobs``, the same functions)."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    processor = LogprobsProcessor(tokenizer=tokenizer, logprobs=None, prompt_logprobs=None, cumulative_logprob=None,
                                  num_logprobs=None, num_prompt_logprobs=None)
    return processor._verify_tokens(decoded_tokens_list=convert_ids_list_to_tokens(tokenizer, list(token_ids)),
                                    tokens=list(token_ids), context_token_ids=list(context_ids))
