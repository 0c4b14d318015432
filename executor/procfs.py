"""Process facts read from ``/proc``, with no import of ours (the fork server and the engine
helpers both need them)."""

from __future__ import annotations


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (from /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False
