"""Process facts read from ``/proc``, in one place, with no import of ours (the crash reaper,
the fork server and the engine helpers all need them; the reaper runs on the stdlib alone)."""

from __future__ import annotations

import os
from typing import Iterator


def pids() -> Iterator[int]:
    """Every process id in /proc now."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state first, ppid second; the
    start time is index 19), or None when it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _live(fields: list[bytes] | None) -> bool:
    return fields is not None and fields[0] not in (b"Z", b"X")


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    fields = stat(pid)
    return fields is not None and fields[0] != b"Z"


def start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live process (None: gone or a zombie)."""
    fields = stat(pid)
    return int(fields[19]) if _live(fields) else None


def process_table() -> dict[int, tuple[int, int]]:
    """``pid -> (ppid, start time)`` of every live process we can read (zombies excluded)."""
    table = {}
    for pid in pids():
        fields = stat(pid)
        if _live(fields):
            table[pid] = (int(fields[1]), int(fields[19]))
    return table


def read(pid: int, name: str) -> bytes | None:
    """/proc/<pid>/<name> (``cmdline``, ``maps``, …), or None when gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read()
    except OSError:
        return None


def children(parents: set[int], cmd_prefix: bytes = b"") -> list[int]:
    """Live children of ``parents`` whose command line starts with ``cmd_prefix``."""
    out = []
    for pid in pids():
        fields = stat(pid)
        if not _live(fields) or int(fields[1]) not in parents:
            continue
        if (cmdline := read(pid, "cmdline")) is not None and cmdline.startswith(cmd_prefix):
            out.append(pid)
    return sorted(out)


def mapped(prefix: str, only: set[int] | None = None) -> set[str]:
    """The paths under ``prefix`` that any process we can inspect maps (or only those in ``only``)."""
    key = prefix.encode()
    found: set[str] = set()
    for pid in pids():
        if only is not None and pid not in only:
            continue
        maps = read(pid, "maps")
        for line in (maps or b"").splitlines():
            idx = line.find(key)
            if idx >= 0:
                found.add(line[idx:].split(b" (deleted)")[0].strip().decode(errors="replace"))
    return found


def bound_unix_sockets(pids_: "list[int] | None" = None) -> set[str]:
    """The paths of the Unix sockets live processes have bound, in every network namespace
    one of ``pids_`` (default: every process we can read) is in: ``/proc/<pid>/net/unix``
    shows its own namespace's, once per namespace."""
    seen: set[str] = set()
    out: set[str] = set()
    for pid in [os.getpid(), *(pids() if pids_ is None else pids_)]:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
            if ns in seen:
                continue
            seen.add(ns)
            with open(f"/proc/{pid}/net/unix") as fh:
                out |= {fields[7] for fields in (line.split() for line in fh) if len(fields) > 7}
        except OSError:
            continue
    return out


def owned_by_me(pid: int) -> bool:
    """Whether ``pid`` runs as this process's user."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def wall_clock(ticks: int) -> float:
    """Wall-clock time of a process start time in clock ticks since boot."""
    with open("/proc/stat") as fh:
        btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")
