"""Building and tearing down vLLM's ``AsyncLLM`` on our placement group and executor.

Blocking: the supervisor calls these from worker threads.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

from config import EngineSettings
from executor.events import ADDITIONAL_CONFIG_KEY


@dataclass
class EngineSpec:
    """Everything needed to build one engine generation."""

    settings: EngineSettings
    model_path: str
    served_model_name: str
    generation: int
    instance_id: str  # carried into the worker actor names
    event_endpoint: str
    placement_group: Any
    dtype: str = "auto"


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def build_engine(spec: EngineSpec):
    """Create the ``AsyncLLM`` (engine-core subprocess + Ray worker actors); blocks until up."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    s = spec.settings
    if s.executor == "mp":
        from executor.mp import SupervisedMultiprocExecutor as executor_class
    else:
        from executor.ray_v2 import SupervisedRayExecutor as executor_class

    cpu = is_cpu_platform()
    if cpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(s.kv_cache_space_gib)
    kwargs: dict[str, Any] = dict(s.extra_args)
    kwargs.update(
        model=spec.model_path,
        served_model_name=[spec.served_model_name],
        tensor_parallel_size=s.tensor_parallel_size,
        pipeline_parallel_size=s.pipeline_parallel_size,
        max_model_len=s.max_model_len,
        dtype=spec.dtype,
        enforce_eager=s.enforce_eager,
        seed=s.seed,
        distributed_executor_backend=executor_class,
    )
    if not cpu:
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    engine_args = AsyncEngineArgs(**kwargs)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    if spec.placement_group is not None:
        vllm_config.parallel_config.placement_group = spec.placement_group
    vllm_config.instance_id = spec.instance_id
    vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = {
        "generation": spec.generation,
        "event_endpoint": spec.event_endpoint,
    }
    return AsyncLLM.from_vllm_config(
        vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        disable_log_stats=False,
    )


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
    """Live children of ``parents`` (from /proc) whose command line starts with ``cmd_prefix``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
            if ppid not in parents:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if fh.read().startswith(cmd_prefix):
                    pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(pids)


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
