"""The crash reaper: a small process that outlives the daemon by design.

A daemon killed with SIGKILL (an OOM kill, a crash, ``kill -9``) runs no clean-up. Ray's
head processes die with it (Ray gives them a parent-death signal), but what *they* started
does not: the DashboardAgent and RuntimeEnvAgent of the private cluster stayed for more than
45 s, and the vLLM rings in ``/dev/shm`` stayed for good.

The daemon starts this module first (``python -m executor.reaper``; stdlib only, ≈ 10 MiB)
with a pipe on its stdin. While the daemon lives, the reaper snapshots the daemon's process
tree (pid and start time, so a reused pid is never mistaken for ours) within ``SNAPSHOT_S``
of any new process (``last_pid``)
and writes it to ``--pids-file``. A clean stop writes ``clean`` down the pipe before the
daemon exits. End of file without it means the daemon died: the reaper SIGKILLs every
process of the last snapshot that still runs, and their children (an orphan's parent may
already be gone), removes vLLM's ``/dev/shm`` segments created since the daemon started that no process maps
any more and the daemon's temporary directories (``--temp-dir``: ``multiprocessing``'s, with the
sockets of its fork server and Ray agent, and its runtime directory, with its event socket) and
its control socket (``--control-socket``, unless a live process has bound that path again), and
exits.

The same ``reap`` serves the next daemon's start when the reaper itself was killed too
(``supervisor/crashrecord.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

from executor import ipc
from executor.procfs import owned_by_me, process_table, start_time, wall_clock  # noqa: F401 (re-exported)
from executor.shm import SHM_DIR, sweep, vllm_segments

SNAPSHOT_S = 0.5
# The process table is read again only when a pid was given out since the last read (a new
# process or thread anywhere; on an idle daemon's host about one in 20 s), and at least this
# often: reading every process's stat each 0.5 s was the reaper's whole cost (0.35-0.65 % of
# a core).
RESCAN_S = 10.0
# the names of the temporary directories a reap removes: multiprocessing's, the daemon's own
TEMP_PREFIXES = ("pymp-", "vllm-supervisor-")
Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def descendants(root: int, table: dict[int, tuple[int, int]] | None = None) -> set[Proc]:
    """(pid, start time) of every live descendant of ``root``."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: set[Proc] = set()
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.add((pid, table[pid][1]))
        todo += children.get(pid, ())
    return out


def reap(known: set[Proc], rounds: int = 10, pause_s: float = 0.2, spare: set[int] = frozenset()) -> list[int]:
    """SIGKILL every process of ``known`` that still runs (same pid *and* start time) and
    every descendant of those; repeated until none is left (children forked meanwhile).
    Returns the pids killed."""
    killed: list[int] = []
    targets = set(known)
    spare = set(spare) | {1, os.getpid()}
    for _ in range(rounds):
        table = process_table()
        alive = {pid for pid, st in targets if table.get(pid, (0, None))[1] == st and pid not in spare}
        for pid in list(alive):
            alive |= {p for p, _ in descendants(pid, table)} - spare
        alive = {pid for pid in alive if _ours(pid)}
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        targets |= {(pid, table[pid][1]) for pid in alive if pid in table}
        time.sleep(pause_s)
    return sorted(set(killed))


def _ours(pid: int) -> bool:
    """A process of this user (root may reap anyone's: systemd runs the daemon as its own user)."""
    return os.getuid() == 0 or owned_by_me(pid)


def sweep_when_unmapped(candidates: set[str], wait_s: float = 10.0) -> list[str]:
    """Remove the candidate segments once no process maps them (killed processes unmap as
    they exit); returns the removed names."""
    removed: list[str] = []
    deadline = time.monotonic() + wait_s
    while True:
        removed += sweep(candidates & vllm_segments())
        if not (candidates & vllm_segments()) or time.monotonic() > deadline:
            return removed
        time.sleep(0.2)


def segments_since(when: float) -> set[str]:
    """This user's vLLM segments created at or after ``when`` (wall clock; one-second slack:
    boot time is whole seconds)."""
    out = set()
    for name in vllm_segments():
        try:
            st = os.stat(SHM_DIR / name)
        except FileNotFoundError:
            continue
        if st.st_ctime >= when - 1.0 and st.st_uid == os.getuid():
            out.add(name)
    return out


def write_pids(path: Path | None, procs: set[Proc]) -> None:
    """Best effort: a snapshot that cannot be written only loses the next start's fallback."""
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(sorted(procs)))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def last_pid() -> int | None:
    """The pid the kernel gave out last in this pid namespace (``/proc/loadavg``'s fifth field):
    unchanged, no process or thread was started since. None when it cannot be read or means
    nothing (gVisor's ``/proc/loadavg`` always says 0)."""
    try:
        with open("/proc/loadavg", "rb") as fh:
            return int(fh.read().split()[4]) or None
    except (OSError, IndexError, ValueError):
        return None


def read_pids(path: Path) -> set[Proc]:
    try:
        return {(int(p), int(s)) for p, s in json.loads(path.read_text())}
    except (OSError, ValueError, TypeError):
        return set()


def watch(daemon_pid: int, daemon_start: int, pids_file: Path | None, stream=None, temp_dirs: tuple[Path, ...] = (),
          control_socket: str = "") -> dict:
    """Snapshot the daemon's tree until its pipe closes; reap if it closed without ``clean``.
    ``daemon_start`` is the daemon's start time (ticks) as the daemon read it: the shared
    memory swept is only what appeared since. ``temp_dirs``: the daemon's own temporary
    directories (``multiprocessing``'s and its runtime directory, which its exit removes),
    and ``control_socket``, its control socket's path: removed after a reap."""
    stream = stream or sys.stdin.buffer
    daemon_started = wall_clock(daemon_start)
    seen: set[Proc] = set()
    clean = False
    me = os.getpid()
    scanned: tuple[int | None, float] = (None, 0.0)  # the last pid given out, and when, at the last read
    again = True  # read once more at the next tick
    while True:
        pid_now = last_pid()  # before the read: a process started during it is read next time
        changed = pid_now is None or pid_now != scanned[0]
        if changed or again or time.monotonic() - scanned[1] >= RESCAN_S:
            # the kernel gives out a pid a moment before its process shows in /proc: after a
            # change, the table is read at the next tick too
            again = changed
            scanned = (pid_now, time.monotonic())
            table = process_table()
            now = descendants(daemon_pid, table) - {(me, table.get(me, (0, 0))[1])}
            if now - seen:
                seen = {p for p in seen if table.get(p[0], (0, None))[1] == p[1]} | now
                write_pids(pids_file, seen)
        ready, _, _ = select.select([stream], [], [], SNAPSHOT_S)
        if ready:
            line = stream.readline()
            if not line:
                break
            clean = clean or line.strip() == b"clean"
    if clean:
        if pids_file is not None:
            pids_file.unlink(missing_ok=True)
        return {"clean": True}
    started = time.monotonic()
    killed = reap(seen, spare={me})
    removed = sweep_when_unmapped(segments_since(daemon_started))
    if pids_file is not None:
        pids_file.unlink(missing_ok=True)
    temp_removed = [str(d) for d in temp_dirs if remove_temp_dir(d)]
    return {"clean": False, "killed": killed, "shm_removed": removed, "temp_dirs_removed": temp_removed,
            "control_socket_removed": remove_dead_socket(control_socket), "took_s": round(time.monotonic() - started, 2)}


def remove_temp_dir(path: Path) -> bool:
    """A dead daemon's temporary directory: its ``multiprocessing`` directory (the sockets of its
    engine-core fork server and its Ray agent) or its own runtime directory (its event socket),
    only one of those names (``TEMP_PREFIXES``) and of this user."""
    try:
        if not path.name.startswith(TEMP_PREFIXES) or path.lstat().st_uid != os.getuid() or not path.is_dir():
            return False
    except OSError:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists()


def remove_dead_socket(path: str) -> bool:
    """A dead daemon's control socket (``/tmp`` unless systemd gave it a runtime directory): a
    socket file of this user's that no live process has bound (the next daemon on the same
    port binds the same path)."""
    try:
        st = os.lstat(path) if path else None
    except OSError:
        return False
    if st is None or not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return False
    return bool(ipc.sweep({path})[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor.reaper")
    parser.add_argument("--pid", type=int, required=True, help="the daemon's pid")
    parser.add_argument("--start-time", type=int, required=True, help="the daemon's start time (clock ticks since boot)")
    parser.add_argument("--pids-file", type=Path, help="where to keep the snapshot of the daemon's processes")
    parser.add_argument("--temp-dir", type=Path, action="append", default=[],
                        help="a temporary directory of the daemon's, removed after a reap (repeatable)")
    parser.add_argument("--control-socket", default="", help="the daemon's control socket, removed after a reap")
    args = parser.parse_args(argv)
    if os.getppid() != args.pid or start_time(args.pid) != args.start_time:
        print(json.dumps({"level": "error", "logger": "vllm_supervisor.reaper", "event": "not started by a live daemon",
                          "daemon_pid": args.pid}), file=sys.stderr, flush=True)
        return 2
    # A terminal's Ctrl-C reaches the whole foreground process group: the daemon drains and
    # says "clean"; the reaper must not go first. SIGHUP is the daemon's reload.
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    result = watch(args.pid, args.start_time, args.pids_file, temp_dirs=tuple(args.temp_dir),
                   control_socket=args.control_socket)
    if not result["clean"]:
        record = {"time": time.time(), "level": "warning", "logger": "vllm_supervisor.reaper",
                  "event": "daemon died: its processes and shared memory reaped", "daemon_pid": args.pid, **result}
        print(json.dumps(record), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
