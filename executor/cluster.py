"""The Ray connection, each replica's placement group, and actor clean-up.

Every function here blocks (they call Ray): the supervisor runs them in worker
threads, never on its event loop.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray
import tenacity
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup, placement_group, remove_placement_group

from config import RaySettings


class PlacementGroupTimeout(RuntimeError):
    """The placement group could not be placed before its deadline."""


CLAIM_PREFIX = "vllm_Claim_"  # + the worker's name after WORKER_PREFIX (executor.ray_v2 names its claims so)
WORKER_PREFIX = "vllm_Worker_"
# How long a claim waits for its killed worker's process to exit: more than a raylet's
# SIGKILL of a worker that does not answer the kill (5 s, measured on Ray 2.60).
CLAIM_RELEASE_WAIT_S = 10.0


log = logging.getLogger("vllm_supervisor.cluster")

SPREAD_WAIT_S = 5.0  # how long a replica's group waits for a node of its own before it may share one
# A raylet that does not accept a connection from here within this is unreachable: above Linux's first
# SYN retransmission (1 s), so one lost packet does not shun a healthy node.
NODE_REACH_TIMEOUT_S = 2.5


def answers(address: str, port: int, timeout_s: float = NODE_REACH_TIMEOUT_S, refused: bool = True) -> bool:
    """Whether a TCP connection from this host to ``address:port`` gets an answer within
    ``timeout_s``: accepted, or refused when ``refused`` (the link works, nothing listens); a
    timeout or no route: no answer."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return refused
    except OSError:
        return False


@dataclass
class RayCluster:
    """Owns this daemon's connection to Ray (and the local cluster when it started one)."""

    settings: RaySettings
    started_local: bool = False

    def connect(self) -> str:
        """Connect (or start a local cluster); returns the GCS address.

        ``RAY_ADDRESS`` is exported so that vLLM's engine-core subprocess joins this
        cluster instead of starting a second local one.
        """
        if ray.is_initialized():
            return os.environ["RAY_ADDRESS"]
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if self.settings.address:
            ray.init(address=self.settings.address, namespace=self.settings.namespace, log_to_driver=False)
        else:
            private_token()
            ray.init(
                address="local",  # never attach to another cluster found on this machine
                namespace=self.settings.namespace,
                num_cpus=self.settings.num_cpus,
                include_dashboard=False,
                object_store_memory=self.settings.object_store_memory_mib << 20,
                log_to_driver=False,
            )
            self.started_local = True
        address = ray.get_runtime_context().gcs_address
        os.environ["RAY_ADDRESS"] = address
        return address

    @staticmethod
    def node_id() -> str:
        """The Ray node this process is attached to (the daemon's host)."""
        return ray.get_runtime_context().get_node_id()

    @staticmethod
    def reachable() -> bool:
        """Whether the GCS answers (the cluster still exists)."""
        try:
            return bool(ray.is_initialized() and ray.nodes())
        except Exception:
            return False

    def shutdown(self) -> None:
        if ray.is_initialized():
            if self.started_local:
                kill_autoscaler_monitor()
            ray.shutdown()

    # --- placement group -----------------------------------------------------------

    def create_placement_group(self, name: str, num_bundles: int, device: str,
                               others: list[PlacementGroup] | tuple = (), first_bundle_here: bool = False,
                               unreachable: dict[str, str] | None = None) -> PlacementGroup:
        """One bundle per worker ({"CPU": 1} or {"GPU": 1}); waits until it is placed.

        Replicas spread across nodes: when ``others`` (the other replicas' groups) hold
        nodes and another alive node is big enough, the group first asks (a bundle label
        selector on ``ray.io/node-id``) for nodes the others do not use, for up to
        ``SPREAD_WAIT_S``; then it may share a node like any group.

        ``first_bundle_here``: the first bundle is on this node, whatever the spreading
        (vLLM's compiled-graph executor refuses a group without a bundle on its engine core's
        node, which is this one: ``ray_utils._verify_bundles``; vLLM pins its own groups the
        same way).

        ``unreachable`` (node id -> address, ``unreachable_nodes``): nodes Ray still counts
        alive that this host cannot reach (a partition Ray's health checks have not caught
        yet): no bundle goes there, for the whole wait. Without that, a group Ray places on
        such a node waits until the link heals or Ray marks the node dead (30 s and more);
        with it the group uses the capacity that is left, or times out naming those nodes
        (the owner waits for capacity and asks again: a healed node is used again).

        Waiting retries with exponential backoff and jitter up to
        ``placement_timeout_s``; on timeout the error names what is missing.
        """
        bundles = [{device: 1.0} for _ in range(num_bundles)]
        here = [{NODE_ID_LABEL_KEY: ray.get_runtime_context().get_node_id()}] if first_bundle_here else []
        unreachable = unreachable or {}
        shunned = sorted(unreachable)
        used = sorted({n for pg in others for n in self.placement_group_nodes(pg)} - set(shunned))
        if used and any(n["Alive"] and n["NodeID"] not in used and n["NodeID"] not in unreachable
                        and n["Resources"].get(device, 0) >= num_bundles - len(here) for n in ray.nodes()):
            avoid = here + [{NODE_ID_LABEL_KEY: f"!in({','.join(used + shunned)})"} for _ in bundles[len(here):]]
            pg = placement_group(bundles, strategy=self.settings.placement_strategy, name=name, bundle_label_selector=avoid)
            if pg.wait(timeout_seconds=SPREAD_WAIT_S):
                return pg
            remove_placement_group(pg)
        rest = [{NODE_ID_LABEL_KEY: f"!in({','.join(shunned)})"} if shunned else {} for _ in bundles[len(here):]]
        pg = placement_group(bundles, strategy=self.settings.placement_strategy, name=name,
                             bundle_label_selector=here + rest if here or shunned else None)

        @tenacity.retry(
            retry=tenacity.retry_if_result(lambda ready: not ready),
            wait=tenacity.wait_exponential_jitter(initial=0.2, max=5.0),
            stop=tenacity.stop_after_delay(self.settings.placement_timeout_s),
            retry_error_callback=lambda state: False,
        )
        def wait_placed() -> bool:
            return pg.wait(timeout_seconds=1)

        if not wait_placed():
            total = ray.cluster_resources().get(device, 0)
            free = ray.available_resources().get(device, 0)
            remove_placement_group(pg)
            raise PlacementGroupTimeout(
                f"placement group {name!r} needs {num_bundles} bundle(s) of {{{device}: 1}} "
                f"({self.settings.placement_strategy}); cluster has {total:g} {device}, "
                f"{free:g} free; not placed within {self.settings.placement_timeout_s:g} s"
                + (f"; not using node(s) unreachable from this host: {', '.join(sorted(unreachable.values()))}"
                   if unreachable else "")
            )
        return pg

    @staticmethod
    def unreachable_nodes(timeout_s: float = NODE_REACH_TIMEOUT_S) -> dict[str, str]:
        """Nodes Ray counts alive whose raylet does not accept a connection from this host
        within ``timeout_s``: node id -> address. A partitioned node stays alive to Ray until
        its health checks fail (``RAY_health_check_*`` on the head: 30 s and more), and so does
        a node whose raylet just died (its host refuses the port) for a few seconds more; a TCP
        connection to its raylet's port from here tells both at once. One connection per node,
        all at once."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if not nodes:
            return {}
        with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
            answered = list(pool.map(lambda n: answers(n["NodeManagerAddress"], int(n["NodeManagerPort"]), timeout_s,
                                                       refused=False), nodes))
        if not any(answered):  # this very host's raylet among them: the check, not the network, is wrong here
            log.warning("no raylet of %d accepts a connection from this host: placing as Ray says", len(nodes))
            return {}
        return {n["NodeID"]: n["NodeManagerAddress"] for n, ok in zip(nodes, answered) if not ok}

    @staticmethod
    def placement_group_nodes(pg: PlacementGroup) -> list[str]:
        """The ids of the nodes its bundles are placed on."""
        table = ray.util.placement_group_table(pg)
        return sorted(set((table.get("bundles_to_node_id") or {}).values()))

    @staticmethod
    def placement_group_ready(pg: PlacementGroup) -> bool:
        state = ray.util.placement_group_table(pg).get("state")
        return state == "CREATED"

    @staticmethod
    def remove_placement_group(pg: PlacementGroup) -> None:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed, or the cluster is gone
            pass

    @classmethod
    def remove_leftovers(cls, daemon_id: str) -> dict[str, list[str]]:
        """Remove what a crashed daemon ``daemon_id`` left on this cluster: its placement
        groups (``<id>-pg``, ``<id>-r<replica>-pg``) and its named actors (workers, standbys, bundle claims). Ray
        frees a dead driver's own actors and groups itself; the engine core's workers belong
        to another job, and a cluster may not have noticed the death yet."""
        from ray.util.placement_group import PlacementGroup
        from ray._raylet import PlacementGroupID

        groups = []
        for pg_id, info in ray.util.placement_group_table().items():
            name = info.get("name") or ""  # <id>-pg, <id>-r<replica>-pg
            if name.startswith(f"{daemon_id}-") and name.endswith("-pg") and info.get("state") not in ("REMOVED", None):
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
                groups.append(pg_id)
        actors = []
        for namespace, name in cls.actors_named(f"_{daemon_id}-g"):
            try:
                kill_named(name, namespace)
                actors.append(name)
            except ValueError:
                pass
        return {"placement_groups": groups, "actors": actors}

    # --- actors --------------------------------------------------------------------

    @staticmethod
    def actors_named(substring: str) -> list[tuple[str, str]]:
        """``(namespace, name)`` of live named actors whose name contains ``substring``."""
        found = ray.util.list_named_actors(all_namespaces=True)
        return [(a["namespace"], a["name"]) for a in found if substring in a["name"]]

    @staticmethod
    def workers(instance_id: str) -> list[dict]:
        return worker_actors(instance_id)

    @staticmethod
    def kill_actor_exact(name: str) -> list[str]:
        """Kill the live named actor ``name`` (any namespace); returns [name] or []."""
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"] == name:
                kill_named(name, a["namespace"])
                return [name]
        return []

    @classmethod
    def kill_instance_actors(cls, instance_id: str, release_wait_s: float = CLAIM_RELEASE_WAIT_S) -> list[str]:
        """Kill every live named actor of engine ``instance_id`` (workers, standbys adopted
        for it), then release its bundle claims once those workers' processes are gone
        (``release_claims``); returns names."""
        killed, claims = [], []
        for namespace, name in cls.actors_named(f"_{instance_id}"):
            if not names_instance(name, instance_id):
                continue
            if name.startswith(CLAIM_PREFIX):
                claims.append((namespace, name))
                continue
            try:
                kill_named(name, namespace)
                killed.append(name)
            except ValueError:  # died meanwhile
                pass
        if claims:
            pids = worker_pids(instance_id)  # Ray keeps a dead actor's pid
            handles = []
            for namespace, name in claims:
                try:
                    with _KILL_LOOKUP:  # its class is Ray-only (executor.claim): a real handle is cheap
                        handle = ray.get_actor(name, namespace=namespace)
                except ValueError:
                    continue
                handles.append((handle, pids.get(name[len(CLAIM_PREFIX):], [])))
                killed.append(name)
            release_claims(handles, release_wait_s)
        return killed


def private_token() -> None:
    """Give the private cluster token auth with a token of its own, in this process's
    environment only, so that every process the daemon starts (the Ray agent, the fork
    server, engine cores, workers) inherits both and joins with it.

    Its GCS, raylet and workers listen on every interface (Ray 2.60 binds ``*`` even with
    ``_node_ip_address=127.0.0.1``) behind Ray's token auth, and without a token Ray writes
    one to ``~/.ray/auth_token`` with mode 0644: any local user who can enter the home
    directory could then drive the cluster. A token in the environment is never written to
    disk. ``RAY_AUTH_MODE`` must be exported too: ``ray.init()`` turns token mode on only in
    the process that starts the cluster, and a client given an address (vLLM's engine core
    with ``RAY_ADDRESS``) never turns it on by itself, so it would connect with auth
    "disabled" and be refused. The operator's own ``RAY_AUTH_MODE`` (``disabled`` included)
    and ``RAY_AUTH_TOKEN`` win."""
    import secrets

    if os.environ.get("RAY_AUTH_MODE", "token").lower() == "disabled":
        return
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if not os.environ.get("RAY_AUTH_TOKEN"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def kill_autoscaler_monitor() -> None:
    """Kill the local cluster's autoscaler monitor now, before ``ray.shutdown`` stops the rest.

    Ray's stop of a local cluster sends each of its processes SIGTERM and gives it a second
    before SIGKILL (``Node._kill_process_type``). The monitor, which has nothing to scale on a
    local cluster, does not exit within it: measured on this machine, it took 1.02 s of
    ``ray.shutdown``'s 1.19 s, every time, and ended killed. Here it gets that SIGKILL at once,
    through Ray's own kill-and-reap (``allow_graceful=False``); the other processes still
    get Ray's graceful stop."""
    from ray._private import ray_constants
    from ray._private import worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    if node is None:
        return
    try:
        node._kill_process_type(ray_constants.PROCESS_TYPE_MONITOR, allow_graceful=False,
                                check_alive=False, wait=True)
    except Exception as exc:  # Ray's own stop below still ends it
        log.warning("could not kill Ray's autoscaler monitor first: %s", exc)


class _KillOnly:
    """The class a handle built only to be killed carries (no methods)."""


_KILL_LOOKUP = threading.Lock()


def kill_named(name: str, namespace: str) -> None:
    """``ray.kill`` (no restart) the live named actor ``name``, without importing its class.

    ``ray.get_actor`` builds a full handle, and so imports the module of the actor's class:
    for vLLM's workers that is vLLM and torch, ≈ 5 s on 2 cores inside a recovery and
    ≈ 600 MiB that the Ray agent (which needs neither) would otherwise have to hold from its
    start. A kill needs only the handle's registration in Ray's core worker, which the
    lookup makes before it loads the class (``make_actor_handle``, Ray 2.60): for this
    lookup the class loader answers with a class of no methods, and the method metadata
    Ray caches for it is dropped again. Every lookup by name in this process goes through
    here (the lock keeps the stand-in from any other). Raises ValueError when no such
    actor is alive, as ``ray.get_actor`` does."""
    from ray._private.worker import global_worker
    from ray.actor import _ActorClassMethodMetadata

    manager = global_worker.function_actor_manager
    with _KILL_LOOKUP:
        cached = set(_ActorClassMethodMetadata._cache)
        manager.load_actor_class = lambda job_id, descriptor: _KillOnly
        try:
            handle = ray.get_actor(name, namespace=namespace)
        finally:
            del manager.load_actor_class  # the class's own method again
            for key in set(_ActorClassMethodMetadata._cache) - cached:
                _ActorClassMethodMetadata._cache.pop(key, None)
    ray.kill(handle, no_restart=True)


def worker_pids(instance_id: str) -> dict[str, list[int]]:
    """The pids Ray recorded for engine ``instance_id``'s worker actors, dead or alive, by
    name without ``vllm_Worker_`` (a replaced standby leaves two records of one name)."""
    from ray._private import state

    out: dict[str, list[int]] = {}
    for info in state.actors().values():
        name = info.get("Name") or ""
        if name.startswith(WORKER_PREFIX) and names_instance(name, instance_id) and info.get("Pid"):
            out.setdefault(name[len(WORKER_PREFIX):], []).append(int(info["Pid"]))
    return out


def release_claims(claims: list[tuple[object, list[int]]], wait_s: float = CLAIM_RELEASE_WAIT_S) -> list[dict]:
    """Release bundle claims after their workers: each claim ``(handle, worker pids)`` waits on
    its node until those processes are gone, off the GPU too (``BundleClaim.wait_gone``,
    bounded by ``wait_s``), and only then are the claims killed. A claim released earlier
    would let the next generation's worker be placed on a GPU whose memory the old one
    still holds. Returns what each claim saw (``[]`` when none answered)."""
    refs = [handle.wait_gone.remote(pids, wait_s) for handle, pids in claims if pids]
    deadline = time.monotonic() + wait_s + 5.0
    seen = []
    for ref in refs:  # one by one: a claim that died (its node) must not cut the others' waits short
        try:
            seen.append(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
        except Exception as exc:  # that claim died, or its wait overran: released anyway, bounded
            seen.append({"gone": False, "error": f"{type(exc).__name__}: {exc}"[:200]})
    kill_handles([handle for handle, _ in claims])
    if any(not s.get("gone") for s in seen):
        log.warning("bundle claims released with a worker not seen gone: %s", seen)
    elif seen:
        log.info("bundle claims released after their workers: %s", seen)
    return seen


def kill_handles(handles: list) -> None:
    """``ray.kill`` (no restart) each actor handle; one already gone is skipped."""
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass


def names_instance(name: str, instance_id: str) -> bool:
    """Whether actor ``name`` belongs to engine ``instance_id`` (``..._<id>`` or ``..._<id>_TP1``):
    ``-g1`` must not match ``-g12``."""
    return name.endswith(f"_{instance_id}") or f"_{instance_id}_" in name


def worker_actor_name(instance_id: str, rank: int, tp: int, pp: int) -> str:
    """The name vLLM gives the worker actor of ``rank`` (``vllm_Worker_<instance id>[_TP<r>][_PP<r>]``)."""
    from vllm.v1.executor.ray_utils import build_actor_name

    return build_actor_name(instance_id, rank, tp, pp, 1)


def worker_actors(instance_id: str) -> list[dict]:
    """Live worker actors of one engine: rank, name, pid, node id (Ray's GCS actor table)."""
    from ray._private import state

    out = []
    for actor_id, info in state.actors().items():
        name = info.get("Name", "")
        if name.startswith("vllm_Worker_") and names_instance(name, instance_id) and info.get("State") == "ALIVE":
            tp = name.rsplit("_TP", 1)[1].split("_")[0] if "_TP" in name else "0"
            out.append({"rank": int(tp) if tp.isdigit() else 0, "name": name, "pid": info.get("Pid"),
                        "node_id": info.get("Address", {}).get("NodeID"), "actor_id": actor_id})
    return sorted(out, key=lambda w: w["rank"])
