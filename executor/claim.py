"""The bundle claim: a tiny actor that holds an adopted worker's bundle resources (GPU hosts).

Kept apart from ``executor.standby`` so that its Ray worker process imports Ray only, not
vLLM: it is started on a recovery's critical path.

It runs on its worker's node, so it is also where that worker's end can be seen: Ray marks a
killed actor DEAD before its process has exited (a worker that does not answer the kill, hung
or stopped, lives on until its raylet's SIGKILL about 5 s later, holding its device memory).
``wait_gone`` returns once the process has exited and, where NVML answers, no GPU lists it as
a compute process; only then is the claim, and with it the bundle's GPU, released
(``executor.cluster.release_claims``).
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import ray

from executor.procfs import running

POLL_S = 0.05


def _nvml() -> Any:
    """NVML's Python binding: ``pynvml`` (nvidia-ml-py) or vLLM's own copy, loaded by path
    (importing ``vllm`` would cost seconds here); None where neither loads or no driver answers."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        spec = importlib.util.find_spec("vllm")
        path = spec and spec.submodule_search_locations and f"{list(spec.submodule_search_locations)[0]}/third_party/pynvml.py"
        if not path:
            return None
        try:
            spec = importlib.util.spec_from_file_location("_vllm_supervisor_pynvml", path)
            pynvml = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(pynvml)
        except Exception:
            return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver (a CPU host)
        return None
    return pynvml


def gpu_compute_pids(nvml: Any) -> set[int]:
    """Pids that hold a compute context on any GPU of this node (NVML)."""
    pids: set[int] = set()
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        pids |= {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    return pids


class BundleClaim:
    def accelerator_ids(self, device_key: str) -> list[str]:
        return [str(x) for x in ray.get_runtime_context().get_accelerator_ids().get(device_key, [])]

    def wait_gone(self, pids: list[int], timeout_s: float) -> dict:
        """Return when none of ``pids`` (its worker's, on this node) runs or holds a GPU,
        or after ``timeout_s``; says what it saw."""
        started = time.monotonic()
        nvml = _nvml()
        deadline = started + timeout_s
        while True:
            alive = [p for p in pids if running(p)]
            on_gpu = sorted(set(pids) & gpu_compute_pids(nvml)) if nvml is not None else []
            if (not alive and not on_gpu) or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return {"gone": not alive and not on_gpu, "alive": alive, "on_gpu": on_gpu, "nvml": nvml is not None,
                "waited_s": round(time.monotonic() - started, 3)}
