"""``wait_for`` without Python 3.11's lost cancellation; a blocking call in a thread of its own.

``asyncio.wait_for`` in 3.11 can swallow a ``cancel()`` that arrives in the same loop
iteration as the awaited thing completes (CPython gh-86296, fixed in 3.12 by rebuilding
it on ``asyncio.timeout``). A task that loses its cancellation keeps running, and
``asyncio.run`` then waits for it forever at exit: found as the probe task of a stopping
test daemon hanging the suite. This is the 3.12 implementation.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable


async def wait_for(aw: Awaitable[Any], timeout: float | None) -> Any:
    """Like ``asyncio.wait_for``: raises ``TimeoutError`` after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        return await aw


async def in_own_thread(fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` in a thread of its own, not the loop's shared pool (whose few threads may all
    be held by the blocking calls ``fn`` is there to cut short)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the awaiting task)
            loop.call_soon_threadsafe(lambda: done.cancelled() or done.set_exception(exc))
        else:
            loop.call_soon_threadsafe(lambda: done.cancelled() or done.set_result(result))

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
