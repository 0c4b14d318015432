"""The daemon's link to its Ray cluster: connect (a child process, ``executor.rayagent``: every
Ray call of the daemon goes through it), lose (the GCS went away), release (the stop), each
replica's placement group, and the actor queries and kills. Every method blocks on Ray: the
owner calls them from worker threads (``asyncio.to_thread``), never on the event loop.

Without Ray (vLLM's ``mp`` executor) ``cluster`` stays None and every method is a no-op.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from config.settings import RaySettings, Settings
from supervisor import logs

log = logs.get_logger("vllm_supervisor.raylink")


def early_agent(settings: Settings, argv: list[str]) -> Any:
    """The daemon's first Ray agent, spawned before the daemon imports vLLM to parse its flags
    (≈ 10 s): its import of the warm standby's worker class then runs beside that one instead
    of on the first build's path, where the build waited for it (10 s with an operator's
    cluster, 6 s with a private one, measured on 2 cores). Ray does not start here: an
    invalid flag still exits 78 before it does (the caller kills this agent).

    The flags are not parsed yet, so this guesses from argv and the TOML what ``connect``
    will know: no agent for the mp executor or a help page, the class's import for a warm
    standby on Ray's V2 executor. A wrong guess is corrected later: ``connect`` spawns the
    agent not spawned, and kills and replaces one that imports the class for nothing (or
    died); the daemon kills one it does not need (mp after all, given where argv does not
    show it: a ``--config`` YAML), which then cost an import beside the daemon's. A failed
    spawn is logged and leaves the agent to the connect. None: no agent."""
    preload = early_plan(settings, argv)
    if preload is None:
        return None
    from executor.rayagent import RayAgent

    try:
        return RayAgent(settings.ray).spawn(preload=preload)
    except Exception as exc:  # only a head start: connect spawns one as before
        log.warning("could not start the Ray agent ahead; it starts at the connect", error=f"{type(exc).__name__}: {exc}"[:300])
        return None


def early_plan(settings: Settings, argv: list[str]) -> bool | None:
    """``early_agent``'s guess: None for no agent, else whether it imports the worker class."""
    if any(a in ("-h", "--help") or a.startswith("--help=") for a in argv):
        return None
    backend = settings.engine.executor if "executor" in settings.engine.model_fields_set else None
    for i, arg in enumerate(argv):  # vLLM's parser takes both spellings, and "=value"
        name, eq, value = arg.partition("=")
        if name.replace("_", "-") == "--distributed-executor-backend":
            backend = value if eq else (argv[i + 1] if i + 1 < len(argv) else backend)
    if backend == "mp":
        return None
    from executor.engine import uses_compiled_graph
    from supervisor.testhooks import standby_without

    return settings.supervisor.standby == "warm" and not uses_compiled_graph() and "preload" not in standby_without()


class RayLink:
    def __init__(self, settings: RaySettings, daemon_id: str, shape: Callable[[], tuple[int, int]], early: Any = None):
        self.settings = settings  # taken at start: a reload's ray settings apply at the next start
        self._early = early  # the agent spawned before the daemon's vLLM import (early_agent), for the first connect
        self.daemon_id = daemon_id
        self._shape = shape  # (tensor, pipeline) parallel sizes: a replica's ranks
        self.cluster: Any = None  # executor.rayagent.RayAgent once connected
        self.cluster_lost = False  # the agent was killed: its GCS went away (connect again)
        self.released = False  # the stop released the cluster
        self.placement_groups: dict[int, Any] = {}  # replica -> its placement group
        self.predecessor_id = ""  # a crashed daemon's id whose Ray leftovers to remove (crashrecord)
        self._placing = threading.Lock()  # one placement group at a time: each sees where the others are
        # whether the agent imports the standby worker's class beside Ray's start (a warm standby's daemon)
        self.preload_worker_class: Callable[[], bool] = lambda: False

    def connect(self) -> None:
        from executor.rayagent import RayAgent

        preload = self.preload_worker_class()
        agent, self._early = self._early, None
        # not one that would hold vLLM for nothing, nor one that died waiting (a crash in its import)
        if agent is not None and ((agent.preloading and not preload) or not agent.alive()):
            log.info("the Ray agent spawned ahead is not used", alive=agent.alive(), imports_the_worker_class=agent.preloading,
                     worker_class_wanted=preload)
            agent.kill()
            agent = None
        early = agent is not None
        agent = agent or RayAgent(self.settings)
        try:
            address = agent.start(preload=preload)
        except BaseException:
            agent.kill()
            raise
        self.cluster, self.cluster_lost = agent, False
        log.info("ray connected", address=address, local=agent.started_local, agent_pid=agent.pid, agent_spawned_early=early)
        if self.predecessor_id:
            removed = self.cluster.call("remove_leftovers", self.predecessor_id)
            log.warning("removed a crashed predecessor's Ray leftovers", predecessor_id=self.predecessor_id, **removed)
            self.predecessor_id = ""

    def drop_early(self) -> None:
        """Kill the early agent (``early_agent``) if no connect took it: no Ray after all (the
        mp executor), or a stop first."""
        agent, self._early = self._early, None
        if agent is not None:
            agent.kill()

    def call(self, method: str, *args: Any) -> Any:
        return self.cluster.call(method, *args)

    # --- placement groups -------------------------------------------------------------

    @property
    def _world_size(self) -> int:
        tp, pp = self._shape()
        return tp * pp

    def placement_group_name(self, replica: int) -> str:
        return f"{self.daemon_id}-pg" if replica == 0 else f"{self.daemon_id}-r{replica}-pg"

    def placement_group(self, replica: int, ready: bool = False) -> Any:
        """Replica ``replica``'s placement group (None: none; with ``ready``, also None when
        it lost bundles)."""
        pg = self.placement_groups.get(replica)
        if pg is None or not ready:
            return pg
        return pg if self.cluster.call("placement_group_ready", pg) else None

    def ensure_placement_group(self, replica: int = 0) -> None:
        """Reuse the replica's placement group while all its bundles are placed on nodes this
        host can reach, else re-create it, on a node that holds no other replica's group when
        there is one, and never on a node this host cannot reach (a partition Ray has not
        caught yet: ``RayCluster.create_placement_group``)."""
        if self.cluster is None:  # the mp executor: no Ray, no placement group
            return
        with self._placing:
            self._ensure_placement_group(replica)

    def _ensure_placement_group(self, replica: int) -> None:
        from executor.engine import is_cpu_platform, uses_compiled_graph

        unreachable = self.cluster.call("unreachable_nodes")  # partitioned from here, alive to Ray
        pg = self.placement_groups.get(replica)
        if pg is not None:
            cut_off = self.cut_off(replica, unreachable)
            if not cut_off and self.cluster.call("placement_group_ready", pg):
                return
            log.warning("placement group lost bundles; re-creating it" if not cut_off else
                        "placement group holds bundles on nodes this host cannot reach; re-creating it elsewhere",
                        replica=replica, unreachable=cut_off)
            self.cluster.call("remove_placement_group", pg)
            del self.placement_groups[replica]
        device = "CPU" if is_cpu_platform() else "GPU"
        started = time.monotonic()
        others = [g for r, g in list(self.placement_groups.items()) if r != replica]
        pg = self.cluster.call("create_placement_group", self.placement_group_name(replica), self._world_size, device, others,
                               uses_compiled_graph(),  # its engine core (this node) must hold a bundle
                               unreachable)
        self.placement_groups[replica] = pg
        log.info("placement group ready", replica=replica, bundles=self._world_size, device=device,
                 nodes=self.cluster.call("placement_group_nodes", pg), took_s=round(time.monotonic() - started, 3),
                 avoided=sorted(unreachable.values()))

    def cut_off(self, replica: int, unreachable: dict[str, str] | None = None) -> list[str]:
        """The addresses of the nodes holding ``replica``'s placement group that this host
        cannot reach (``RayCluster.unreachable_nodes``; asked now unless given)."""
        pg = self.placement_groups.get(replica)
        if pg is None or self.cluster is None or self.cluster_lost:
            return []
        try:
            if unreachable is None:
                unreachable = self.cluster.call("unreachable_nodes")
            return sorted(unreachable[n] for n in self.cluster.call("placement_group_nodes", pg) if n in unreachable) if unreachable else []
        except Exception as exc:  # the agent gone: nothing known to be cut off
            log.warning("could not tell which nodes are reachable", error=str(exc))
            return []

    def release(self) -> None:
        self.drop_early()  # a stop before the first connect
        if self.cluster is None or self.cluster_lost:
            return
        self.released = True  # from now on a GCS that stops listening is ours going (private cluster)
        for pg in list(self.placement_groups.values()):
            self.cluster.call("remove_placement_group", pg)
        self.placement_groups.clear()
        self.cluster.stop()
        log.info("ray released", stopped_local_cluster=self.cluster.started_local)

    # --- loss of the cluster (its GCS) ------------------------------------------------------

    @property
    def gcs_address(self) -> str:
        """The GCS the daemon is connected to ("" without Ray, and once released)."""
        return self.cluster.address if self.cluster is not None and not self.released else ""

    @property
    def agent_pid(self) -> int | None:
        return self.cluster.pid if self.cluster is not None else None

    def agent_alive(self) -> bool:
        return self.cluster is None or self.cluster.alive()

    def mark_lost(self) -> bool:
        """The GCS went away: nothing more is asked of the agent, and the placement groups are
        forgotten (the new cluster has none). No Ray call; False when already lost or none."""
        if self.cluster is None or self.cluster_lost:
            return False
        self.cluster_lost = True
        self.placement_groups.clear()
        return True

    def kill_agent(self) -> list[int]:
        """Kill the lost cluster's agent (and a private cluster's processes) before a new GCS
        can answer it."""
        killed = self.cluster.kill() if self.cluster is not None else []
        log.warning("ray agent killed: the cluster is lost", killed_pids=killed)
        return killed

    def reachable(self) -> bool:
        if self.cluster is None:
            return True
        try:
            return self.cluster.call("reachable")
        except Exception:  # the agent gone or Ray raising: not reachable
            return False

    # --- actors ---------------------------------------------------------------------

    def kill_actors(self, instance_id: str) -> list[str]:
        if self.cluster is None or self.cluster_lost:  # lost: its actors went with the cluster
            return []
        try:
            return self.cluster.call("kill_instance_actors", instance_id)
        except Exception as exc:
            log.warning("could not list/kill actors", error=str(exc))
            return []

    def kill_worker(self, instance_id: str, rank: int) -> list[str]:
        from executor.cluster import worker_actor_name

        return self.cluster.call("kill_actor_exact", worker_actor_name(instance_id, rank, *self._shape()))

    def workers(self, instance_id: str) -> list[dict[str, Any]]:
        if self.cluster is None:
            return []
        return self.cluster.call("workers", instance_id)
