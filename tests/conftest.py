"""Fixtures shared by the integration and chaos tiers."""

import pytest

from chaos.harness import RayHead


@pytest.fixture(scope="module")
def ray_head():
    """A private Ray head (``ray start --head``) per test module, stopped by marker afterwards."""
    head = RayHead(num_cpus=2).start()
    try:
        yield head
    finally:
        try:
            import ray

            ray.shutdown()  # the test process may have connected to inject faults
        finally:
            head.stop()
