"""What a run left behind, found without knowing what to look for.

A leak check that looks for known names (``psm_*`` rings, ``vllm_Worker`` actors) or follows
known parents misses the new kind of segment and the process orphaned to init. ``Leaks``
snapshots the whole of ``/dev/shm`` and every process when a test begins; at the end, whatever
is new in ``/dev/shm`` and every process of this user, in this session, started since and
still running, that descends from this process or was orphaned (re-parented to init), is a
leftover, less a short named allow-list (``allow``: the trees of what the test keeps running
on purpose, like another live daemon or the Ray head it started as an operator). So is a new Unix
socket in a directory of the temporary directory (``multiprocessing``'s ``pymp-*``, whatever
made it) that no live process has bound: the trace of a process killed before it could remove
it. And so is a new torch file store of vLLM's (``vllm_dist_*`` in the temporary directory, the
``mp`` executor's rendezvous), which its last user removes unless killed first.

Stdlib only (the smoke of ``.ci/`` runs it before anything else is imported).
"""

from __future__ import annotations

import os
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

SHM = Path("/dev/shm")
Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def processes() -> dict[int, dict]:
    """Every live process we can read (zombies excluded): pid -> ppid, session, start, uid."""
    from executor import procfs

    out = {}
    for pid in procfs.pids():
        fields = procfs.stat(pid)
        if fields is not None and fields[0] not in (b"Z", b"X"):
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            out[pid] = {"ppid": int(fields[1]), "sid": int(fields[3]), "start": int(fields[19]), "uid": uid}
    return out


def tree(roots: Iterable[int], table: dict[int, dict]) -> set[int]:
    """``roots`` (those alive) and all their live descendants."""
    children: dict[int, list[int]] = {}
    for pid, p in table.items():
        children.setdefault(p["ppid"], []).append(pid)
    out: set[int] = set()
    todo = [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, ())
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def when_made(paths: Iterable[str]) -> list[str]:
    """Each path with the UTC time its file was made (its inode's change time), to place a
    leak among the daemon's log lines."""
    out = []
    for path in paths:
        try:
            out.append(f"{path} (made {time.strftime('%H:%M:%S', time.gmtime(os.stat(path).st_ctime))} UTC)")
        except OSError:
            out.append(f"{path} (gone since)")
    return out


def temp_sockets(root: str | None = None, top: bool = False) -> set[str]:
    """The Unix sockets in the directories of the temporary directory (one level down, where
    ``multiprocessing`` puts its listeners), and with ``top`` in it too (where vLLM puts its
    ZeroMQ sockets unless told otherwise)."""
    out = set()
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
        dirs = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        if top:
            out = {e.path for e in entries if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)}
    except OSError:
        return out
    for d in dirs:
        try:
            out |= {e.path for e in os.scandir(d) if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)}
        except OSError:
            continue
    return out


def temp_stores() -> set[str]:
    """vLLM's torch file stores (``vllm_dist_<hex>``) in the temporary directory."""
    from executor.ipc import store_files

    return store_files()


def bound_sockets(table: dict[int, dict]) -> set[str]:
    """The paths of the Unix sockets live processes have bound, in every network namespace
    one of ``table``'s processes is in."""
    from executor.procfs import bound_unix_sockets

    return bound_unix_sockets(list(table))


def mapped_by(pids: set[int]) -> set[str]:
    """``/dev/shm`` names mapped (or held open) by ``pids``."""
    from executor import procfs

    return {path[len("/dev/shm/"):] for path in procfs.mapped("/dev/shm/", set(pids))} if pids else set()


def open_files(pid: int) -> dict[str, int]:
    """What ``pid``'s descriptors point at (``socket:[123]``, ``pipe:[456]``, paths) -> the
    fd's access mode (0 read, 1 write, 2 both, from ``fdinfo``)."""
    out: dict[str, int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            with open(f"/proc/{pid}/fdinfo/{fd}") as fh:
                flags = next(int(line.split()[1], 8) for line in fh if line.startswith("flags:"))
        except (OSError, StopIteration, ValueError):
            continue
        out[target] = max(out.get(target, 0), flags & 3)
    return out


def inherited(daemon: int, children: Iterable[int], reaper: int | None = None) -> dict[int, list[str]]:
    """Per child of ``daemon``: the daemon's sockets it holds (listening sockets, the asyncio
    signal wake-up socket, any other: a child that was not forked shares none) and the write
    end of the crash reaper's pipe (the reaper's stdin, whose end of file is the daemon's
    death). Empty when nothing was inherited."""
    ours = {t for t in open_files(daemon) if t.startswith("socket:")}
    if reaper is not None:
        try:
            ours.add(os.readlink(f"/proc/{reaper}/fd/0"))  # its stdin: the pipe only the daemon writes
        except OSError:
            pass
    found = {}
    for pid in children:
        if pid == reaper:
            continue
        held = sorted(t for t in open_files(pid) if t in ours)
        if held:
            found[pid] = [f"{t} ({cmdline(pid)[:60]})" for t in held]
    return found


class Leaks:
    """A snapshot now; ``new()`` later lists what appeared since and is still there."""

    def __init__(self, top_sockets: bool = True) -> None:
        """``top_sockets``: new sockets in the temporary directory itself count too (where
        vLLM puts its ZeroMQ sockets unless told otherwise; ``bench.common.VllmServe`` gives
        `vllm serve`, which leaves 7 there at every start, a directory of its own)."""
        self.top = top_sockets
        self.me = os.getpid()
        self.uid = os.getuid()
        self.sid = os.getsid(0)
        self.before: set[Proc] = {(pid, p["start"]) for pid, p in processes().items()}
        self.shm_before = set(os.listdir(SHM))
        self.sockets_before = temp_sockets(top=self.top)
        self.stores_before = temp_stores()

    def new(self, allow: Callable[[], Iterable[int]] = lambda: ()) -> dict[str, object]:
        """{"processes": {pid: command line}, "shm": [names], "sockets": [paths], "stores":
        [paths]}: what is new and not allowed (a new socket is a leftover once no live process
        has it bound; a new file store once nothing is running, as a live engine uses its own).
        ``allow`` gives the roots of process trees the caller keeps on purpose (their
        descendants and the segments they map are allowed too)."""
        table = processes()
        mine = tree([self.me], table) - {self.me}
        allowed = tree(allow(), table)
        found = {}
        for pid, p in table.items():
            if (pid, p["start"]) in self.before or pid in allowed or pid == self.me:
                continue
            if p["uid"] != self.uid or p["sid"] != self.sid:
                continue  # another user's, or another session's (a shell beside this run)
            if pid in mine or p["ppid"] == 1:  # ours, or orphaned to init
                found[pid] = cmdline(pid)
        shm = set(os.listdir(SHM)) - self.shm_before - (mapped_by(allowed) if allowed else set())
        return {"processes": found, "shm": sorted(shm), "sockets": self.dead_sockets(table),
                "stores": sorted(temp_stores() - self.stores_before)}

    def dead_sockets(self, table: dict[int, dict] | None = None) -> list[str]:
        """The new sockets in the temporary directory's directories (and with ``top_sockets``
        in it) that no live process has bound: while a daemon runs, what its torn-down engine
        generations left in its runtime directory."""
        sockets = temp_sockets(top=self.top) - self.sockets_before
        return sorted(sockets - bound_sockets(processes() if table is None else table)) if sockets else []

    def wait_clean(self, settle_s: float = 15, allow: Callable[[], Iterable[int]] = lambda: ()) -> dict[str, object]:
        """Poll ``new()`` until it is empty or ``settle_s`` passed; returns the last (empty
        when clean)."""
        deadline = time.monotonic() + settle_s
        while True:
            left = self.new(allow)
            if not any(left.values()):
                return {}
            if time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def kill_new(self, allow: Callable[[], Iterable[int]] = lambda: ()) -> None:
        """Last resort after a failure: SIGKILL what is new, unlink new segments no process maps,
        new file stores, and new sockets no process has bound (and their directory, when that
        leaves it empty)."""
        from executor.ipc import remove

        left = self.new(allow)
        for pid in left["processes"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        in_use = mapped_by(set(processes()))
        for name in left["shm"]:
            if name not in in_use:
                try:
                    (SHM / name).unlink()
                except OSError:
                    pass
        remove(set(left["stores"]))
        table = processes()
        for path in sorted((temp_sockets(top=self.top) - self.sockets_before) - bound_sockets(table)):
            try:
                os.unlink(path)
                if os.path.dirname(path) != tempfile.gettempdir():
                    os.rmdir(os.path.dirname(path))  # only when that left it empty
            except OSError:
                pass
