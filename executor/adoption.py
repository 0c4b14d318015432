"""The executor's side of adopting a standby worker (``executor.standby`` makes them): where
vLLM's executor creates a worker actor, the standby of that name is adopted instead when
one can be. Imported by ``executor.ray_v2``; imports nothing of ours but ``executor.cpu_binding``
(which imports neither), so the standby module can build on the executor's worker class
without a circle."""

from __future__ import annotations

from typing import Any

import ray
from vllm.platforms import current_platform

from executor.cpu_binding import rebinding

# The actor options in which a standby differs from the worker vLLM creates, by design: its
# own name and namespace, no resources (the executor's bundle claim holds them), node affinity
# instead of the placement group. Every other option it must have been created with as vLLM's.
OWN_OPTIONS = frozenset({"name", "namespace", "num_cpus", "num_gpus", "resources", "scheduling_strategy"})
_MISSING = object()


def creation_options(options: dict) -> dict:
    """Of the options vLLM creates a worker actor with, those a standby must share."""
    return {k: v for k, v in options.items() if k not in OWN_OPTIONS}


def option_mismatch(standby: dict, worker: dict) -> list[str]:
    """The options (``runtime_env.env_vars.<VAR>`` for a variable) in which a standby created
    with ``standby`` differs from a worker vLLM creates with ``worker``; empty: it may stand
    for it. The runtime env takes effect when the process starts: it cannot be fixed later, but
    for the cores a CPU worker's OpenMP threads are bound to (``binding_change``)."""
    standby, worker = creation_options(standby), creation_options(worker)
    differ = []
    for key in sorted(set(standby) | set(worker)):
        if key == "runtime_env":
            ours, theirs = dict(standby.get(key) or {}), dict(worker.get(key) or {})
            env_ours, env_theirs = ours.pop("env_vars", None) or {}, theirs.pop("env_vars", None) or {}
            fixed = rebinding(env_ours, env_theirs) or {}  # rebound at adoption
            differ += [f"runtime_env.env_vars.{v}" for v in sorted(set(env_ours) | set(env_theirs))
                       if env_ours.get(v) != env_theirs.get(v) and v not in fixed]
            differ += [f"runtime_env.{k}" for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        elif standby.get(key, _MISSING) != worker.get(key, _MISSING):
            differ.append(key)
    return differ


def binding_change(standby: dict, worker: dict) -> dict[str, str]:
    """The OpenMP binding a standby created with options ``standby`` takes at adoption to stand
    for a worker vLLM creates with ``worker`` (``executor.cpu_binding.rebinding``): {} when none
    (or when it cannot, which ``option_mismatch`` reports)."""
    env_of = lambda options: (options.get("runtime_env") or {}).get("env_vars") or {}  # noqa: E731
    return rebinding(env_of(standby), env_of(worker)) or {}


def bundle_node(placement_group: Any, bundle_index: int) -> str:
    """The id of the node ``placement_group``'s bundle ``bundle_index`` is placed on."""
    from ray.util.placement_group import placement_group_table

    return placement_group_table(placement_group)["bundles_to_node_id"][bundle_index]


def actor_node(handle: Any) -> str:
    """The id of the node Ray's actor table places the actor of ``handle`` on ("" when it does
    not say): read from the GCS, no call to the actor."""
    from ray._private import state

    info = state.actors(actor_id=handle._actor_id.hex()) or {}
    return (info.get("Address") or {}).get("NodeID") or ""


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


def claim_bundle(strategy: Any, name: str, resources: dict, namespace: str) -> tuple[Any, list[str]]:
    """A claim actor holding ``resources`` of the bundle ``strategy`` names; returns it and
    the device ids Ray gave it. Detached: it must outlive the engine core that creates it
    (an owner's death takes its actors at once, in no order), to be released only after its
    worker has gone (``executor.cluster.release_claims``); it still goes with the placement group."""
    device_key = current_platform.ray_device_key
    from executor.claim import BundleClaim

    claim = ray.remote(BundleClaim).options(name=name, namespace=namespace, lifetime="detached", num_cpus=0,
                                            scheduling_strategy=strategy, **resources).remote()
    return claim, ray.get(claim.accelerator_ids.remote(device_key))
