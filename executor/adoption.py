"""The executor's side of adopting a standby worker (``executor.standby`` makes them): where
vLLM's executor creates a worker actor, the standby of that name is adopted instead when
one can be. Imported by ``executor.ray_v2``; imports nothing of ours, so the standby
module can build on the executor's worker class without a circle."""

from __future__ import annotations

from typing import Any

import ray
from vllm.platforms import current_platform

CLAIM_PREFIX = "vllm_Claim_"


def bundle_node(placement_group: Any, bundle_index: int) -> str:
    """The id of the node ``placement_group``'s bundle ``bundle_index`` is placed on."""
    from ray.util.placement_group import placement_group_table

    return placement_group_table(placement_group)["bundles_to_node_id"][bundle_index]


class AdoptingRay:
    """Stands in for the ``ray`` module inside vLLM's executor module while it creates its
    workers: ``ray.remote(cls).options(name=...).remote(**init)`` returns the standby named
    ``name`` (after ``adopt``) when one can be adopted, else creates the actor as vLLM
    would. Everything else is Ray's."""

    def __init__(self, real_ray: Any, adopt: Any):
        self._ray = real_ray
        self._adopt = adopt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ray, name)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return _AdoptingActorClass(self._ray.remote(*args, **kwargs), self._adopt)


class _AdoptingActorClass:
    def __init__(self, actor_class: Any, adopt: Any):
        self._actor_class = actor_class
        self._adopt = adopt

    def options(self, **options: Any) -> "_AdoptingCall":
        return _AdoptingCall(self._actor_class.options(**options), options, self._adopt)


class _AdoptingCall:
    def __init__(self, wrapper: Any, options: dict, adopt: Any):
        self._wrapper = wrapper
        self._options = options
        self._adopt = adopt

    def remote(self, **init_kwargs: Any) -> Any:
        handle = self._adopt(self._options, init_kwargs)
        return handle if handle is not None else self._wrapper.remote(**init_kwargs)


def claim_bundle(strategy: Any, name: str, resources: dict) -> tuple[Any, list[str]]:
    """A claim actor holding ``resources`` of the bundle ``strategy`` names; returns it and
    the device ids Ray gave it."""
    device_key = current_platform.ray_device_key
    from executor.claim import BundleClaim

    claim = ray.remote(BundleClaim).options(name=name, num_cpus=0, scheduling_strategy=strategy,
                                            **resources).remote()
    return claim, ray.get(claim.accelerator_ids.remote(device_key))
