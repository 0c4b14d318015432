"""``health.loop_histogram.LoopHistogram``: the request path's histograms, exposed as
prometheus-client's ``Histogram`` exposes the same observations."""

import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import metrics as client_metrics
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from health.loop_histogram import LoopHistogram
from health.metrics import ITL_BUCKETS

# every bound, just above and below each, zero, negative and far above the last
VALUES = [0.0, -1.0, 1e9] + [v for b in ITL_BUCKETS for v in (b, b * (1 - 1e-9), b * (1 + 1e-9))]


def _pair(values, buckets=ITL_BUCKETS):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("vllm_supervisor_x_seconds", "doc", buckets, ours)
    ref = Histogram("vllm_supervisor_x_seconds", "doc", buckets=buckets, registry=theirs)
    for v in values:
        loop.observe(v)
        ref.observe(v)
    return loop, ours, theirs


def _same_but_created(a: bytes, b: bytes) -> bool:
    strip = lambda s: re.sub(rb"(_created(\{[^}]*\})?) \S+", rb"\1 T", s)  # noqa: E731 (the time of creation differs)
    return strip(a) == strip(b)


@pytest.mark.parametrize("generate", [generate_latest, generate_openmetrics], ids=["text", "openmetrics"])
def test_exposition_equals_prometheus_clients_histogram(generate):
    loop, ours, theirs = _pair(VALUES)
    a, b = generate(ours), generate(theirs)
    assert b"_created" in a and _same_but_created(a, b), (a.decode(), b.decode())
    assert loop.count == len(VALUES) and loop.sum == pytest.approx(sum(VALUES))


def test_empty_histogram_exposes_every_bucket_at_zero():
    _, ours, theirs = _pair([])
    a = generate_latest(ours)
    assert _same_but_created(a, generate_latest(theirs))
    assert a.count(b"_bucket{") == len(ITL_BUCKETS) + 1


def test_created_series_follows_prometheus_clients_switch():
    client_metrics.disable_created_metrics()
    try:
        _, ours, theirs = _pair([0.5])
        a = generate_latest(ours)
        assert b"_created" not in a and a == generate_latest(theirs)
    finally:
        client_metrics.enable_created_metrics()


def test_registry_refuses_a_second_series_of_the_same_name():
    registry = CollectorRegistry()
    LoopHistogram("vllm_supervisor_x_seconds", "doc", (1,), registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram("vllm_supervisor_x_seconds", "doc", registry=registry)


@pytest.mark.parametrize("buckets", [(), (1, 1), (2, 1), (1, float("inf"))])
def test_bad_buckets_are_refused(buckets):
    with pytest.raises(ValueError, match="buckets"):
        LoopHistogram("x_seconds", "doc", buckets, CollectorRegistry())
