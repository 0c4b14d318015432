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

from config.settings import RaySettings
from supervisor import logs

log = logs.get_logger("vllm_supervisor.raylink")


class RayLink:
    def __init__(self, settings: RaySettings, daemon_id: str, shape: Callable[[], tuple[int, int]]):
        self.settings = settings  # taken at start: a reload's ray settings apply at the next start
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

        agent = RayAgent(self.settings)
        try:
            address = agent.start(preload=self.preload_worker_class())
        except BaseException:
            agent.kill()
            raise
        self.cluster, self.cluster_lost = agent, False
        log.info("ray connected", address=address, local=agent.started_local, agent_pid=agent.pid)
        if self.predecessor_id:
            removed = self.cluster.call("remove_leftovers", self.predecessor_id)
            log.warning("removed a crashed predecessor's Ray leftovers", predecessor_id=self.predecessor_id, **removed)
            self.predecessor_id = ""

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
