"""``/dev/shm`` segments that a vLLM engine leaves behind.

Workers are stopped with ``ray.kill`` and a dead engine core never runs its
finalizers, so their shared-memory rings (``psm_*``) and the CPU communicator's
``*cpushm*`` files stay; the compiled-graph executor's Ray channels leave their named POSIX
semaphores (``sem.hdr<pid>-*``, ``sem.obj<pid>-*``); on GPU hosts NCCL's shared-memory
transport and proxy leave ``nccl-*`` (``ncclShmOpen``'s ``/dev/shm/nccl-XXXXXX``) when a rank is killed. We attribute segments to an engine generation by what
appeared while it was being built, and remove only those of ours that no live
process still maps.
"""

from __future__ import annotations

import re
from multiprocessing import resource_tracker
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_VLLM_SEGMENT = re.compile(r"^(psm_|wnsm_|nccl-|sem\.(hdr|obj)\d+-)|cpushm")


def vllm_segments(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of segments in ``shm_dir`` that look like vLLM's."""
    try:
        return {p.name for p in shm_dir.iterdir() if _VLLM_SEGMENT.search(p.name)}
    except FileNotFoundError:
        return set()


def mapped_segments(shm_dir: Path = SHM_DIR, pids: set[int] | None = None) -> set[str]:
    """Names of segments of ``shm_dir`` mapped by any process we can inspect (or only by
    those in ``pids``)."""
    from executor.procfs import mapped

    prefix = f"{shm_dir}/"
    return {path[len(prefix):] for path in mapped(prefix, pids)}


def sweep(candidates: set[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the candidates that still exist and no live process maps; returns them, and
    this process's resource tracker forgets them (``forget``)."""
    if not candidates:
        return []
    in_use = mapped_segments(shm_dir)
    removed = []
    for name in sorted(candidates - in_use):
        try:
            (shm_dir / name).unlink()
            removed.append(name)
        except (FileNotFoundError, PermissionError):  # gone, or another user's (sticky /dev/shm)
            pass
    if shm_dir == SHM_DIR:
        forget(removed)
    return removed


def forget_gone(names: set[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Of a torn-down generation's rings, those already gone: their engine core unlinked
    them itself, and its unregister may never have reached the tracker (vLLM unlinks a
    ring, then unregisters it; a failed engine core is killed while its own shutdown runs,
    and in 3 of 4 query-of-death runs the kill fell between the two). The tracker forgets
    them (``forget``); returns them."""
    gone = sorted(name for name in names if not (shm_dir / name).exists())
    if shm_dir == SHM_DIR:
        forget(gone)
    return gone


def forget(names: list[str]) -> None:
    """Tell this process's ``multiprocessing`` resource tracker, if it runs, that the
    ``/dev/shm`` segments ``names`` are gone.

    An engine core, spawned or forked by the fork server, shares the daemon's tracker, and a
    vLLM ring registers there as it is created (``SharedMemory(create=True)``). A killed
    engine core never unregisters it, so once a teardown had removed it, the tracker warned
    at the daemon's exit of every such ring ("There appear to be N leaked shared_memory
    objects to clean up at shutdown", then "No such file or directory" for each). A register
    first makes the unregister safe whether or not the tracker knew the name: an unknown
    name's unregister is a ``KeyError`` the tracker prints. Only ``psm_*``, the names
    ``SharedMemory`` makes: the others here are made by C++ (torch's CPU communicator's
    ``*cpushm*``, NCCL's, Ray's semaphores) and never registered, and a name with a colon
    (``…-tp:0-…-cpushm_0``) breaks the tracker's line format."""
    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_fd", None) is None:
        return  # no tracker in this process (nor one it inherited): nothing was registered
    for name in names:
        if name.startswith("psm_"):
            tracker.register(f"/{name}", "shared_memory")
            tracker.unregister(f"/{name}", "shared_memory")
