"""Wait for processes on this host to exit, on the event loop, without polling.

A pidfd (``pidfd_open``, Linux 5.3+) becomes readable when its process has exited, zombie or
reaped, child of this process or not; the loop waits on it as on a socket. The warm standby
(``supervisor.standby``) watches its fork server and its local worker processes this way
instead of reading Ray's actor table every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Mapping


class ProcessExits:
    """The processes ``pids`` (name → pid) watched from now until ``close``: ``exited`` lists
    the names of those that have exited, in the order seen (one already gone is there at once).

    Raises OSError when this host has no pidfds (a kernel before 5.3, or a seccomp filter that
    refuses the call); the caller polls instead."""

    def __init__(self, pids: Mapping[str, int]):
        self._loop = asyncio.get_running_loop()
        self._fds: dict[str, int] = {}
        self.exited: list[str] = []
        self._seen = asyncio.Event()
        try:
            for name, pid in pids.items():
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:  # gone before the watch began
                    self._exit(name)
                    continue
                self._fds[name] = fd
                self._loop.add_reader(fd, self._exit, name)
        except BaseException:
            self.close()
            raise

    def _exit(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)
        self.exited.append(name)
        self._seen.set()

    async def wait(self, timeout_s: float) -> list[str]:
        """The names of the processes that have exited, once one has or ``timeout_s`` has passed
        (an empty list: none did)."""
        if not self.exited:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._seen.wait(), timeout_s)
        return list(self.exited)

    def close(self) -> None:
        for fd in self._fds.values():
            self._loop.remove_reader(fd)
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "ProcessExits":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
