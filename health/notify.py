"""sd_notify over systemd's AF_UNIX datagram socket (``NOTIFY_SOCKET``); a no-op without it.

systemd reads ``READY=1``, ``STATUS=…``, ``STOPPING=1``, ``RELOADING=1`` (+ ``MONOTONIC_USEC``),
``WATCHDOG=1`` and ``EXTEND_TIMEOUT_USEC=…``; see sd_notify(3).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable


class SystemdNotifier:
    def __init__(self, address: str | None = None):
        self.address = os.environ.get("NOTIFY_SOCKET", "") if address is None else address
        self._sock: socket.socket | None = None
        if self.address:
            # Non-blocking: a reader that falls behind must never stall the event loop.
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        watchdog_usec = os.environ.get("WATCHDOG_USEC", "")
        watchdog_pid = os.environ.get("WATCHDOG_PID", "")
        applies = not watchdog_pid or watchdog_pid == str(os.getpid())
        self.watchdog_interval_s = int(watchdog_usec) / 2e6 if watchdog_usec.isdigit() and applies else None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str) -> None:
        if self._sock is None:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._sock.sendto("\n".join(lines).encode(), target)
        except OSError:
            pass  # systemd went away or its queue is full: dropping beats blocking

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def reloading(self) -> None:
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")


async def watchdog_loop(notifier: SystemdNotifier, starting: Callable[[], bool], terminal: Callable[[], bool]) -> None:
    """WATCHDOG=1 every WATCHDOG_USEC/2 from the event loop itself (a stuck loop stops them)
    and only while the daemon is not ``terminal()``; EXTEND_TIMEOUT_USEC while ``starting()``
    (the first engine is being built)."""
    import asyncio

    if not notifier.enabled:
        return
    interval = notifier.watchdog_interval_s
    tick = min(interval, 10.0) if interval else 10.0
    last_ping = 0.0
    while True:
        if starting():
            notifier.extend_timeout(3 * tick)
        now = time.monotonic()
        if interval and now - last_ping >= interval and not terminal():
            notifier.watchdog()
            last_ping = now
        await asyncio.sleep(tick)
