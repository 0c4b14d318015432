"""The bundle claim: a tiny actor that holds an adopted worker's bundle resources (GPU hosts).

Kept apart from ``executor.standby`` so that its Ray worker process imports Ray only, not
vLLM: it is started on a recovery's critical path.
"""

from __future__ import annotations

import ray


class BundleClaim:
    def accelerator_ids(self, device_key: str) -> list[str]:
        return [str(x) for x in ray.get_runtime_context().get_accelerator_ids().get(device_key, [])]
