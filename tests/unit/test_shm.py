"""``executor.shm``: which ``/dev/shm`` segments are an engine's, and the sweep that removes
only those no live process maps (a real mapping, read from ``/proc/*/maps``)."""

from __future__ import annotations

import mmap

from executor.shm import sweep, vllm_segments

ENGINE = ["psm_1a2b3c", "wnsm_0f", "sem.hdr123-0", "sem.obj123-1", "vllm_cpushm_0", "nccl-Ab3dEf"]
OTHERS = ["postgres.1234", "sem.mp-abc", "pym-77-xyz", "mynccl"]


def test_the_engines_segments_nccls_included(tmp_path):
    for name in ENGINE + OTHERS:
        (tmp_path / name).write_bytes(b"\0" * 4096)
    assert vllm_segments(tmp_path) == set(ENGINE)


def test_the_sweep_keeps_what_a_live_process_maps(tmp_path):
    for name in ENGINE:
        (tmp_path / name).write_bytes(b"\0" * 4096)
    with open(tmp_path / "nccl-Ab3dEf", "r+b") as fh, mmap.mmap(fh.fileno(), 4096):  # a live rank's
        removed = sweep(vllm_segments(tmp_path), tmp_path)
        assert sorted(removed) == sorted(set(ENGINE) - {"nccl-Ab3dEf"})
        assert [p.name for p in tmp_path.iterdir()] == ["nccl-Ab3dEf"]
    assert sweep(vllm_segments(tmp_path), tmp_path) == ["nccl-Ab3dEf"]  # unmapped now
