"""``wait_for`` without Python 3.11's lost cancellation.

``asyncio.wait_for`` in 3.11 can swallow a ``cancel()`` that arrives in the same loop
iteration as the awaited thing completes (CPython gh-86296, fixed in 3.12 by rebuilding
it on ``asyncio.timeout``). A task that loses its cancellation keeps running, and
``asyncio.run`` then waits for it forever at exit: found as the probe task of a stopping
test daemon hanging the suite. This is the 3.12 implementation.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable


async def wait_for(aw: Awaitable[Any], timeout: float | None) -> Any:
    """Like ``asyncio.wait_for``: raises ``TimeoutError`` after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        return await aw
