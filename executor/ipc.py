"""The ZeroMQ ``ipc://`` socket files an engine leaves in vLLM's RPC directory.

vLLM names each of an engine's ZeroMQ endpoints ``ipc://<VLLM_RPC_BASE_PATH>/<uuid>``
(``vllm.utils.network_utils.get_open_zmq_ipc_path``): the engine core's input and output
sockets, its start-up hand-shake and the executor's message queues, seven for one engine on
the Ray V2 executor. ZeroMQ unlinks such a file only when the socket that bound it is closed;
a killed engine core or worker closes nothing, so each failed generation left its seven empty
files behind until the daemon stopped (the daemon points vLLM at its own runtime directory,
``supervisor.cli``). As with the shared-memory rings (``executor.shm``), a generation's files
are the ones that appeared while it was being built, and only those no live process still
has bound are removed.
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
    removed = []
    for path in sorted(present - bound):
        try:
            os.unlink(path)
            removed.append(path)
        except (FileNotFoundError, PermissionError):  # gone, or another user's (a sticky /tmp)
            pass
    return removed, bound
