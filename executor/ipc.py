"""The files an engine leaves in the temporary directories: the ZeroMQ ``ipc://`` socket
files in vLLM's RPC directory, and the ``mp`` executor's torch file store.

vLLM names each of an engine's ZeroMQ endpoints ``ipc://<VLLM_RPC_BASE_PATH>/<uuid>``
(``vllm.utils.network_utils.get_open_zmq_ipc_path``): the engine core's input and output
sockets, its start-up hand-shake and the executor's message queues, seven for one engine on
the Ray V2 executor. ZeroMQ unlinks such a file only when the socket that bound it is closed;
a killed engine core or worker closes nothing, so each failed generation left its seven empty
files behind until the daemon stopped (the daemon points vLLM at its own runtime directory,
``supervisor.cli``). As with the shared-memory rings (``executor.shm``), a generation's files
are the ones that appeared while it was being built, and only those no live process still
has bound are removed.

The ``mp`` executor's workers meet through a torch ``FileStore``, ``vllm_dist_<hex>`` in the
temporary directory (``vllm.utils.network_utils.get_file_store_init_method``). torch removes it
when its last user closes it; a killed worker never does, so each failed generation left one.
Nothing binds a regular file: a generation's store is removed once its workers are killed.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def rpc_dir() -> Path:
    """Where vLLM puts its ``ipc://`` endpoints (its default is the temporary directory)."""
    return Path(os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir())


def socket_files(directory: Path | None = None) -> set[str]:
    """The paths of the Unix socket files in ``directory`` (default ``rpc_dir()``)."""
    try:
        with os.scandir(directory or rpc_dir()) as entries:
            return {e.path for e in entries if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)}
    except OSError:
        return set()


def store_files(directory: Path | None = None) -> set[str]:
    """The paths of vLLM's torch file stores in ``directory`` (default: the temporary directory)."""
    try:
        with os.scandir(directory or tempfile.gettempdir()) as entries:
            return {e.path for e in entries if e.name.startswith("vllm_dist_") and e.is_file(follow_symlinks=False)}
    except OSError:
        return set()


def remove(paths: set[str]) -> list[str]:
    """Unlink ``paths`` (file stores whose workers are gone, sockets nothing binds); returns
    those removed."""
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except (FileNotFoundError, PermissionError):  # gone, or another user's (a sticky /tmp)
            pass
    return removed


def sweep(candidates: set[str]) -> tuple[list[str], set[str]]:
    """Unlink the candidates that still exist and no live process has bound (in any network
    namespace a process we can read is in: a worker of a real-host test's namespace binds in
    the same directory); returns them, and the candidates still there because they are bound."""
    from executor.procfs import bound_unix_sockets

    if not candidates:
        return [], set()
    # the files first, then who binds them: a file listed before the read is in it while bound
    present = {path for path in candidates if os.path.lexists(path)}
    bound = present & bound_unix_sockets()
    return remove(present - bound), bound
