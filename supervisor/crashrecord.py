"""Crash-only start: the run record a daemon leaves, and cleaning after a predecessor that
left one because it crashed.

Each daemon writes ``<data_dir>/run/daemon-<hostname>-<listen address>.json`` (its pid and start time,
its daemon id, the Ray address it used, its control socket) and starts the crash reaper
(``executor/reaper.py``), which keeps the pids of the daemon's processes beside it. A clean
stop removes both. A daemon that finds a record whose process is gone cleans, before it
builds anything:

* the predecessor's processes, when its reaper died with it (its pids file; a pid counts
  only with the same start time; a reaper still at work is waited for);
* ``/dev/shm`` segments of vLLM's that no process maps (older than a few seconds: one being
  created right now by another daemon is not touched);
* the stale control socket (``supervisor.control`` also refuses to take over a live one);
* on an existing Ray cluster, the predecessor's placement group and named actors (by its
  daemon id, after Ray is connected: ``RayLink.connect``).

The record and the pids file are trusted only when this user owns them and nobody else may
write to them or their directory.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from executor.reaper import read_pids, reap, remove_temp_dir, start_time
from executor.shm import SHM_DIR, sweep, vllm_segments
from supervisor import logs

log = logs.get_logger("vllm_supervisor.crashrecord")
STALE_SHM_AGE_S = 5.0


def record_path(data_dir: Path, key: str) -> Path:
    """``key``: the daemon's listen address (``<host>-<port>``, or ``uds-<hash>``)."""
    return Path(data_dir).expanduser() / "run" / f"daemon-{socket.gethostname()}-{key}.json"


def pids_path(record: Path, pid: int | None = None) -> Path:
    """Where the reaper of daemon ``pid`` (default: this process) keeps its snapshot: one file
    per daemon, so a predecessor's slow reaper never removes its successor's."""
    return record.with_name(f"{record.stem}.{os.getpid() if pid is None else pid}.pids")


@dataclass
class Predecessor:
    """What a daemon that did not stop cleanly left in its record."""

    pid: int
    daemon_id: str = ""
    ray_address: str = ""
    control_socket: str = ""
    reaper: tuple[int, int] | None = None  # (pid, start time)
    temp_dirs: tuple[str, ...] = ()  # its own temporary directories (``RunRecord.temp_dirs``)
    cleaned: dict[str, Any] = field(default_factory=dict)


def _trusted(path: Path) -> bool:
    """Owned by this user, writable by nobody else, in a directory nobody else may write."""
    for p in (path, path.parent):
        st = p.stat()
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
    return True


def read_predecessor(record: Path) -> Predecessor | None:
    """The predecessor of this record if it did not stop cleanly and no longer runs."""
    try:
        if not _trusted(record):
            log.warning("ignoring a run record this user does not own exclusively", path=str(record))
            return None
        data = json.loads(record.read_text())
        pid, started = int(data["pid"]), int(data["start_time"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring an unreadable run record", path=str(record), error=str(exc))
        return None
    if start_time(pid) == started:
        return None  # it still runs (another daemon with this port, e.g. on a Unix socket)
    reaper = data.get("reaper")
    return Predecessor(pid, str(data.get("daemon_id", "")), str(data.get("ray_address", "")),
                       str(data.get("control_socket", "")), tuple(reaper) if isinstance(reaper, list) else None,
                       tuple(str(d) for d in data.get("temp_dirs") or ()))


def clean_local(pred: Predecessor, record: Path) -> dict[str, Any]:
    """Everything of the predecessor's that needs no Ray: processes, shared memory, socket.
    Its own reaper, if it still runs, is given time to finish first."""
    if pred.reaper is not None:
        deadline = time.monotonic() + 20.0
        while start_time(pred.reaper[0]) == pred.reaper[1] and time.monotonic() < deadline:
            time.sleep(0.2)
    pids = pids_path(record, pred.pid)
    killed = reap(read_pids(pids)) if pids.exists() and _trusted(pids) else []
    pids.unlink(missing_ok=True)
    now = time.time()
    stale = set()
    for name in vllm_segments():
        try:
            st = (SHM_DIR / name).stat()
        except FileNotFoundError:
            continue
        if st.st_uid == os.getuid() and now - st.st_mtime > STALE_SHM_AGE_S:
            stale.add(name)
    removed = sweep(stale)
    socket_removed = False
    if pred.control_socket and Path(pred.control_socket).is_socket():
        from supervisor.control import socket_answers

        if not socket_answers(pred.control_socket):
            Path(pred.control_socket).unlink(missing_ok=True)
            socket_removed = True
    temp_removed = [d for d in pred.temp_dirs if remove_temp_dir(Path(d))]
    pred.cleaned = {"processes_killed": killed, "shm_removed": removed, "control_socket_removed": socket_removed,
                    "temp_dirs_removed": temp_removed}
    return pred.cleaned


class RunRecord:
    """This daemon's record and its reaper."""

    def __init__(self, path: Path, own_dirs: tuple[Path, ...] = ()):
        """``own_dirs``: temporary directories this daemon made and its exit removes (its runtime
        directory unless systemd gave it one), which a crash leaves to the reaper; with
        ``multiprocessing``'s (the sockets of the fork server and the Ray agent)."""
        self.path = path
        self.temp_dirs = [multiprocessing.util.get_temp_dir(), *map(str, own_dirs)]
        self.reaper: subprocess.Popen | None = None
        self._pipe: IO[bytes] | None = None

    def write(self, daemon_id: str, ray_address: str, control_socket: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        reaper = [self.reaper.pid, start_time(self.reaper.pid)] if self.reaper else None
        data = {"pid": os.getpid(), "start_time": start_time(os.getpid()), "daemon_id": daemon_id,
                "ray_address": ray_address, "control_socket": control_socket, "started_at": time.time(),
                "reaper": reaper, "temp_dirs": self.temp_dirs}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, self.path)

    def start_reaper(self, control_socket: str = "") -> None:
        """The reaper's stdin is a pipe only this process holds: its end of file is our death."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "executor.reaper", "--pid", str(os.getpid()), "--start-time", str(start_time(os.getpid())),
             "--pids-file", str(pids_path(self.path)), *(f"--temp-dir={d}" for d in self.temp_dirs),
             *([f"--control-socket={control_socket}"] if control_socket else [])],
            stdin=subprocess.PIPE, cwd=str(Path(__file__).resolve().parent.parent), close_fds=True,
        )
        self._pipe = self.reaper.stdin

    def close_clean(self) -> None:
        """A clean stop: tell the reaper, wait for it (bounded), remove the record."""
        if self._pipe is not None:
            try:
                self._pipe.write(b"clean\n")
                self._pipe.close()
            except OSError:
                pass
            try:
                self.reaper.wait(5)
            except subprocess.TimeoutExpired:
                self.reaper.kill()
                self.reaper.wait()
        self.path.unlink(missing_ok=True)
        pids_path(self.path).unlink(missing_ok=True)
