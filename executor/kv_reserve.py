"""The KV cache's memory, faulted in by a standby worker before it is adopted (CPU only).

On a CPU host the adopted worker's largest step after its model is the KV cache's allocation:
vLLM's ``allocate_kv_cache`` makes it with ``torch.zeros`` (one int8 buffer of the explicit KV
size, ``VLLM_CPU_KVCACHE_SPACE``), and the kernel faults in and zeroes each 4 KiB page as it is
first written: about 0.4 s per GiB on the 2-core machine this project is measured on, per worker,
on the recovery's critical path (``docs/benchmarks.md``, "Recovery").

A standby worker that reserves the memory makes that allocation while it waits (``KVReserve``):
zeroed, never written. When vLLM's ``initialize_from_config`` runs in the adopted worker,
``serving`` hands that buffer to vLLM's one ``torch.zeros`` of the KV cache's size (torch's own
``TorchFunctionMode``, scoped to that call: nothing of vLLM is patched); any other allocation,
or a KV cache larger than the reserve, is torch's as before, and the reserve is released before
it. What vLLM does not take is released when the call ends, so the worker never holds the memory
twice. The price: the reserve's memory, held by each standby worker while it waits
(``supervisor.standby_kv``). A GPU's KV cache is device memory, which a standby holds none of.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger("vllm.supervisor.executor")


def numa_nodes() -> int:
    """The NUMA nodes this process may allocate memory from (vLLM's own reading of
    ``Mems_allowed_list``); a reserve made on one of several may not be the worker's node."""
    from vllm.utils.cpu_resource_utils import get_memory_affinity

    return max(1, len(get_memory_affinity()))


def available_bytes() -> int:
    """Memory available to this process, as vLLM's CPU worker measures it before it allocates
    the KV cache (its node's free and reclaimable memory, within a cgroup's limit)."""
    from vllm.utils.cpu_resource_utils import get_memory_affinity, get_memory_node_info

    nodes = get_memory_affinity()
    return get_memory_node_info(nodes[0] if nodes else 0).available_memory


def reserve(nbytes: int) -> "KVReserve | None":
    """A standby's reserve of ``nbytes``, or None (logged) where it would cost more than it saves:
    on a host of several NUMA nodes (vLLM binds the worker's memory to its node only once adopted:
    a reserve made before may sit on another node for the generation's life), where it would leave
    less than one more KV size available (the host's other builds need theirs), or where the
    allocation fails. Never raises: a standby without a reserve is still a standby."""
    if nbytes <= 0:
        return None
    if (nodes := numa_nodes()) > 1:
        logger.info("standby worker: no KV reserve on a host of %d NUMA nodes (its node is chosen at adoption)", nodes)
        return None
    available = available_bytes()
    if available < 2 * nbytes:
        logger.warning("standby worker: no KV reserve: %.2f GiB available, less than twice the KV size (%.2f GiB)",
                       available / 2**30, nbytes / 2**30)
        return None
    try:
        return KVReserve(nbytes)
    except RuntimeError as exc:  # torch's allocator: out of memory
        logger.warning("standby worker: no KV reserve: %s", exc)
        return None


class KVReserve:
    """``nbytes`` of zeroed, faulted-in CPU memory, for one KV cache buffer of at most that size."""

    def __init__(self, nbytes: int):
        started = time.monotonic()
        self.nbytes = nbytes
        self._buf: torch.Tensor | None = torch.zeros(nbytes, dtype=torch.int8)
        self.reserve_s = time.monotonic() - started
        self.taken = False

    @property
    def held(self) -> bool:
        return self._buf is not None

    def take(self, nbytes: int) -> torch.Tensor | None:
        """The first ``nbytes`` of the reserve, zeroed, once; None when it is smaller (then it is
        released, before the caller allocates its own)."""
        buf, self._buf = self._buf, None
        if buf is None or nbytes > buf.numel():
            return None
        self.taken = True
        return buf[:nbytes]

    def release(self) -> None:
        self._buf = None


class _ZerosFromReserve(TorchFunctionMode):
    """Inside it, the first ``torch.zeros(n, dtype=int8)`` on the CPU with ``n`` at least half the
    reserve (the KV cache's backing buffer; vLLM's other tensors are small) gets the reserve."""

    def __init__(self, reserve: KVReserve):
        super().__init__()
        self.reserve = reserve

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.reserve.held and _is_kv_buffer(args, kwargs, self.reserve.nbytes):
            buf = self.reserve.take(int(args[0]))
            if buf is not None:
                return buf
        return func(*args, **kwargs)


def _is_kv_buffer(args: tuple, kwargs: dict, reserved: int) -> bool:
    if len(args) != 1 or not isinstance(args[0], int) or kwargs.get("dtype") is not torch.int8:
        return False
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return False
    return args[0] * 2 >= reserved


@contextmanager
def serving(reserve: KVReserve | None) -> Iterator[None]:
    """Run vLLM's KV cache allocation with ``reserve``'s memory; release what it did not take."""
    if reserve is None or not reserve.held:
        yield
        return
    try:
        with _ZerosFromReserve(reserve):
            yield
    finally:
        if reserve.taken:
            logger.info("KV cache allocated from the standby's reserve (%.2f GiB, faulted in %.2f s before adoption)",
                        reserve.nbytes / 2**30, reserve.reserve_s)
        else:
            logger.warning("the standby's KV reserve (%.2f GiB) was not used by the KV cache allocation; released",
                           reserve.nbytes / 2**30)
        reserve.release()
