"""Fixtures shared by the integration and chaos tiers."""

import os

# Ray 2.60 clusters use token auth; a client reads RAY_AUTH_MODE when Ray is imported, and
# vLLM imports Ray, so it has to be set before any test module is loaded.
os.environ.setdefault("RAY_AUTH_MODE", "token")

import pytest  # noqa: E402

from chaos import inject  # noqa: E402
from chaos.harness import RayHead  # noqa: E402


@pytest.fixture(scope="module")
def ray_head():
    """A private Ray head (``ray start --head``) per test module, stopped by marker afterwards."""
    head = RayHead(num_cpus=2).start()
    try:
        yield head
    finally:
        try:
            inject.disconnect()  # the test process may have connected to inject faults
        finally:
            head.stop()
