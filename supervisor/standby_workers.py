"""What the warm standby (``supervisor.standby``) asks of the layers below: the engine-core
fork server (``executor.forkserver``) and the standby's worker actors (``executor.standby``,
created through the Ray agent on a replica's placement group's nodes). Every method blocks:
the standby calls them through ``asyncio.to_thread``."""

from __future__ import annotations

from typing import Any, Callable

from supervisor.raylink import RayLink


class StandbyWorkers:
    def __init__(self, ray: RayLink, instance_id: Callable[[int], str], namespace: str, uses_ray: Callable[[], bool],
                 reserve_kv: bool = True):
        self.ray = ray
        self.reserve_kv = reserve_kv  # on a CPU host, each worker holds its KV cache's memory (executor.kv_reserve)
        self.instance_id = instance_id  # generation number -> the id its workers are named by
        self.namespace = namespace  # the Ray namespace the standby's workers live in
        self._uses_ray = uses_ray  # the engine's executor now (a reload may change it)

    @property
    def uses_ray(self) -> bool:
        """Ray's executor: standby workers; without Ray (the mp executor) the fork server only."""
        return self._uses_ray()

    @staticmethod
    def start_forkserver() -> float:
        from executor import forkserver

        return forkserver.start()

    @staticmethod
    def forkserver_pid() -> int | None:
        from executor import forkserver

        return forkserver.pid()

    def forkserver_alive(self) -> bool:
        return self.forkserver_pid() is not None

    @staticmethod
    def stop_forkserver() -> None:
        from executor import forkserver

        forkserver.stop()

    def create(self, number: int, vllm_config: Any, replica: int = 0) -> list[dict[str, Any]]:
        """Generation ``number``'s workers, on the nodes of ``replica``'s placement group, with the
        actor options vLLM's executor will give its own (computed here, in the daemon). Only
        while that group is placed: re-creating a lost one is the recovery's job (two threads
        doing it would leak one)."""
        from executor.standby import kv_reserve_bytes, worker_options

        pg = self.ray.placement_group(replica, ready=True)
        if pg is None:
            raise RuntimeError("the placement group is not ready; the next recovery re-creates it")
        # Here, not in the agent: the next engine core starts with this process's environment.
        options = worker_options(vllm_config)
        kv_bytes = kv_reserve_bytes(vllm_config) if self.reserve_kv else 0
        return self.ray.call("create_standby", vllm_config, pg, self.instance_id(number), self.namespace, options, kv_bytes)

    def states(self, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.ray.call("standby_states", [w["actor_id"] for w in workers])

    def kill(self, workers: list[dict[str, Any]], wait_s: float = 5.0) -> None:
        """Kill standby workers and wait (bounded) until Ray has released their names."""
        self.ray.call("kill_standby", [w["actor_id"] for w in workers], wait_s)
