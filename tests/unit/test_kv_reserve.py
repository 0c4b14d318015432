"""A standby's KV memory handed to vLLM's KV cache allocation (``executor.kv_reserve``), with
real torch tensors and vLLM's own ``allocate_kv_cache``."""

import logging

import torch

from executor import kv_reserve
from executor.kv_reserve import KVReserve, serving

MiB = 2**20


def test_vllms_kv_allocation_gets_the_reserve_and_nothing_else_does():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    blocks = 64
    page = spec.page_size_bytes
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[KVCacheTensor(size=page * blocks, layers=["layer.0"],
                                                                             layer_stride=page * blocks, block_stride=page)],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    reserve = KVReserve(page * blocks + 4096)
    start = reserve._buf.data_ptr()
    with serving(reserve):
        small = torch.zeros(8, dtype=torch.int8)  # not the KV cache: torch's own
        kv = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBNHC)
    assert small.data_ptr() != start
    assert kv["layer.0"].untyped_storage().data_ptr() == start  # the reserve's memory, as vLLM's views
    assert not kv["layer.0"].any()
    assert reserve.taken and not reserve.held


def test_a_kv_cache_larger_than_the_reserve_is_allocated_by_torch_and_the_reserve_released():
    reserve = KVReserve(1 * MiB)
    with serving(reserve):
        buf = torch.zeros(2 * MiB, dtype=torch.int8)
    assert buf.numel() == 2 * MiB and not buf.any()
    assert not reserve.taken and not reserve.held


def test_a_reserve_nothing_took_is_released_with_a_warning(caplog):
    reserve = KVReserve(1 * MiB)
    with caplog.at_level(logging.WARNING, logger="vllm.supervisor.executor"), serving(reserve):
        torch.zeros(1 * MiB, dtype=torch.float32)  # another dtype: not the KV cache's buffer
        torch.zeros(MiB // 4, dtype=torch.int8)  # far smaller than the reserve: not it either
    assert not reserve.held and not reserve.taken
    assert "was not used" in caplog.text


def test_no_reserve_changes_nothing():
    with serving(None):
        assert torch.zeros(4, dtype=torch.int8).tolist() == [0, 0, 0, 0]


def test_the_adopted_workers_initialize_from_config_runs_with_the_reserve():
    """``SupervisedRayWorkerProc._execute_worker_rpc``: vLLM's ``initialize_from_config`` RPC, and
    only it, allocates from the reserve; the reserve is gone after it."""
    from types import SimpleNamespace

    from executor.ray_v2 import SupervisedRayWorkerProc

    got = []
    worker = object.__new__(SupervisedRayWorkerProc)
    worker.rank = 0
    worker.handle_output = got.append
    worker.worker = SimpleNamespace(initialize_from_config=lambda n: torch.zeros(n, dtype=torch.int8, device=torch.device("cpu")),
                                    other=lambda n: torch.zeros(n, dtype=torch.int8, device=torch.device("cpu")))
    worker._kv_reserve = KVReserve(1 * MiB)
    start = worker._kv_reserve._buf.data_ptr()
    worker._execute_worker_rpc(("other", (MiB,), {}, None))
    assert got[-1].data_ptr() != start and worker._kv_reserve.held  # not the KV cache's RPC
    worker._execute_worker_rpc(("initialize_from_config", (MiB - 4096,), {}, None))
    assert got[-1].data_ptr() == start and not worker._kv_reserve.held


def test_no_reserve_where_it_would_cost_more_than_it_saves(monkeypatch, caplog):
    monkeypatch.setattr(kv_reserve, "available_bytes", lambda: 100 * MiB)
    monkeypatch.setattr(kv_reserve, "numa_nodes", lambda: 2)
    assert kv_reserve.reserve(MiB) is None  # its node is chosen only at adoption
    monkeypatch.setattr(kv_reserve, "numa_nodes", lambda: 1)
    assert kv_reserve.reserve(MiB).held
    assert kv_reserve.reserve(0) is None
    with caplog.at_level(logging.WARNING, logger="vllm.supervisor.executor"):
        assert kv_reserve.reserve(60 * MiB) is None  # less than one more KV size would be left
        monkeypatch.setattr(kv_reserve, "KVReserve", lambda n: (_ for _ in ()).throw(RuntimeError("can't allocate memory")))
        assert kv_reserve.reserve(MiB) is None  # the allocation failed: a standby without one
    assert "less than twice" in caplog.text and "can't allocate memory" in caplog.text
