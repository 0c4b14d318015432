"""A scrape of ``/metrics`` does not stall the streams: the front renders the metrics in a
thread of its own, as ``vllm serve`` renders its own, and the event loop keeps running."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from supervisor.http import Front


class SlowCollector:
    """A collector that takes ``seconds`` to collect, and notes the threads it ran in."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.threads: list[threading.Thread] = []

    def describe(self):  # no collect at registration
        return []

    def collect(self):
        self.threads.append(threading.current_thread())
        time.sleep(self.seconds)
        yield GaugeMetricFamily("slow_render", "a series that takes long to collect", value=1)


@pytest.mark.parametrize("path", ["/metrics", "/metrics/supervisor"])
def test_metrics_are_rendered_off_the_event_loop_while_it_keeps_serving(path):
    registry = CollectorRegistry()
    slow = SlowCollector(0.3)
    registry.register(slow)
    front = Front(SimpleNamespace(metrics=SimpleNamespace(registry=registry)), args=None)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def scrape() -> tuple[int, threading.Thread]:
        ticks = 0

        async def ticker() -> None:  # a stream's steady work, every 10 ms
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        await front._ours(path, {"query_string": b""}, send)
        task.cancel()
        return ticks, threading.current_thread()

    ticks, loop_thread = asyncio.run(scrape())
    assert slow.threads and all(t is not loop_thread for t in slow.threads)
    assert ticks >= 10, f"the loop ran {ticks} times during a 0.3 s render (about 30 expected)"
    assert sent[0]["status"] == 200
    body = sent[1]["body"]
    assert b"slow_render 1.0" in body
    # /metrics: vLLM's registry (the process-wide one) first, then the supervisor's
    assert (b"python_info" in body) == (path == "/metrics")
