"""``executor.shm``: which ``/dev/shm`` segments are an engine's, and the sweep that removes
only those no live process maps (a real mapping, read from ``/proc/*/maps``)."""

from __future__ import annotations

import ast
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.shm import SHM_DIR, sweep, vllm_segments

ROOT = Path(__file__).resolve().parents[2]

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


RING_OF_A_KILLED_CHILD = '''
import multiprocessing, os, signal, sys
from multiprocessing import shared_memory

from executor.shm import forget_gone, sweep


def make_ring_and_die(names, unlinked):
    ring = shared_memory.SharedMemory(create=True, size=4096)  # as vLLM's ring: registered
    if unlinked:  # its own shutdown unlinked it, and the kill came before the unregister
        import _posixshmem
        _posixshmem.shm_unlink(ring._name)
    names.put(ring.name)
    os.kill(os.getpid(), signal.SIGKILL)  # never unregisters it


if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[1])
    names = ctx.SimpleQueue()
    unlinked = sys.argv[2] == "unlinked"
    child = ctx.Process(target=make_ring_and_die, args=(names, unlinked))
    child.start()
    name = names.get()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL, child.exitcode
    print(forget_gone({name}) if unlinked else sweep({name}))
'''


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("removed_by", ["swept", "unlinked"])
def test_a_swept_ring_of_a_killed_child_is_forgotten_by_the_shared_resource_tracker(tmp_path, method, removed_by):
    """A ring a killed engine core created stays registered with the resource tracker it
    shared with the daemon (spawned, or forked by the fork server); once the sweep removed it,
    that tracker warned at the daemon's exit ("There appear to be 1 leaked shared_memory
    objects", then "No such file or directory"). The same when the engine core unlinked it
    itself and was killed before its unregister (``unlinked``: ``forget_gone``, as a teardown
    calls it). A real tracker, a real child, SIGKILL."""
    script = tmp_path / "ring.py"
    script.write_text(RING_OF_A_KILLED_CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(script), method, removed_by], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    removed = ast.literal_eval(run.stdout.strip())
    assert len(removed) == 1 and removed[0].startswith("psm_")
    assert not (SHM_DIR / removed[0]).exists()
    assert "resource_tracker" not in run.stderr, run.stderr  # the tracker ran to its end (its pipe closed) quiet
