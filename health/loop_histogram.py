"""A histogram observed on the event loop alone, per output token, and read at scrape.

prometheus-client's ``Histogram.observe`` takes a lock and walks its buckets, per bucket
value a ``MutexValue``; on the request path it is observed once per output, and it was a
fifth of what the daemon's stream path added to the engine's (``bench.request_path``,
docs/benchmarks.md). Observed from one thread (the event loop), the bucket counts can be a
plain list that one bisection indexes; the scrape builds the cumulative series from a copy
(a registered ``Collector``), with the same names and samples as ``Histogram``'s
(``_bucket``/``_count``/``_sum``/``_created``), so dashboards and alerts do not change.

A scrape on another thread may read a count that an observation is between updating: its
``_count`` is the sum of the buckets it copied (never out of step with them), and its
``_sum`` may be one observation ahead or behind, as a scrape a moment later would read it.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from typing import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as _client_metrics
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class LoopHistogram:
    """``observe(value)`` from the event loop; the registry reads it at scrape."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = tuple(float(b) for b in buckets)
        if list(self.bounds) != sorted(set(self.bounds)) or not self.bounds or math.isinf(self.bounds[-1]):
            raise ValueError(f"{name}: buckets must be finite and increasing (+Inf is implied)")
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        # bisect_left: the first bound >= amount, i.e. Prometheus's ``le`` bucket
        self._counts[bisect_left(self.bounds, amount)] += 1
        self._sum += amount

    @property
    def sum(self) -> float:
        return self._sum

    @property
    def count(self) -> int:
        return sum(self._counts)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self._counts), self._sum
        running, buckets = 0, []
        for le, count in zip(self._les, counts):
            running += count
            buckets.append((le, running))
        family = HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)
        if getattr(_client_metrics, "_use_created", True):  # as its Histogram (PROMETHEUS_DISABLE_CREATED_SERIES)
            family.add_sample(self.name + "_created", {}, self._created)
        yield family
