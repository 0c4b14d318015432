"""What the warm standby (``supervisor.standby``) asks of the layers below: the engine-core
fork server (``executor.forkserver``) and the standby's worker actors (``executor.standby``,
created through the Ray agent on a replica's placement group's nodes). Every method blocks:
the standby calls them through ``asyncio.to_thread``."""

from __future__ import annotations

import pickle
import socket
import time
from typing import Any, Callable

from supervisor import logs
from supervisor.raylink import RayLink

log = logs.get_logger("vllm_supervisor.standby")


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
        # pickled here: the agent unpickles it (importing vLLM) once its own import is done
        return self.ray.call("create_standby", pickle.dumps(vllm_config), pg, self.instance_id(number), self.namespace, options, kv_bytes)

    def starter(self, number: int, replica: int = 0) -> "WorkerStarter":
        """For a build with no standby workers to adopt (the first, a cold rebuild): a call that
        starts generation ``number``'s workers as standbys once the build has made its config
        (``executor.engine.EngineSpec.start_workers``)."""
        return WorkerStarter(self, number, replica)

    def class_import(self) -> dict[str, Any]:
        """The Ray agent's import of the workers' class ahead (``executor.rayagent.WorkerClassImport``),
        for the log: an agent gone says so instead."""
        try:
            return self.ray.call("worker_class_import")
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:200]}

    def states(self, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.ray.call("standby_states", [w["actor_id"] for w in workers])

    def park(self, workers: list[dict[str, Any]]) -> None:
        """Park ready standby workers (``executor.standby``: their main threads sleep until
        woken instead of waking 100 times a second); each gets its ``wake`` address."""
        for w, address in zip(workers, self.ray.call("park_standby", [w["actor_id"] for w in workers])):
            w["wake"] = tuple(address)

    @staticmethod
    def wake(workers: list[dict[str, Any]], timeout_s: float = 0.5) -> list[str]:
        """Wake parked standby workers: one connection to each one's ``wake`` address. Returns
        those it could not reach (a standby not woken ends its park itself within
        ``executor.standby.PARK_S`` of the first call that reaches it)."""
        missed = []
        for w in workers:
            if not w.get("wake"):
                continue
            try:
                socket.create_connection(w["wake"], timeout=timeout_s).close()
            except OSError as exc:
                missed.append(f"{w['name']}: {type(exc).__name__}: {exc}"[:200])
        return missed

    def kill(self, workers: list[dict[str, Any]], wait_s: float = 5.0) -> None:
        """Kill standby workers and wait (bounded) until Ray has released their names."""
        self.ray.call("kill_standby", [w["actor_id"] for w in workers], wait_s)


class WorkerStarter:
    """A build's own workers, started as standbys of its generation beside its engine core.

    A Ray worker's start is mostly vLLM's import, as long as the engine core's; vLLM's executor
    creates its workers only after the engine core's import, so a cold build imported vLLM
    twice in turn. Called once the build's config is made, before the engine core starts: the
    creation returns once Ray has the actors (they import meanwhile), and the executor adopts
    them by name. The Ray agent imported the worker's class beside Ray's start
    (``executor.rayagent``); had it not, the first creation would import it (≈ 10 s on 2 cores,
    before the engine core starts). A creation that fails is logged and the build goes on as
    vLLM's own (None: vLLM creates the workers)."""

    def __init__(self, workers: StandbyWorkers, number: int, replica: int):
        self.workers, self.number, self.replica = workers, number, replica

    def __call__(self, vllm_config: Any) -> str | None:
        started = time.monotonic()
        try:
            made = self.workers.create(self.number, vllm_config, self.replica)
        except Exception as exc:
            log.warning("could not start the build's workers beside its engine core; vLLM creates them",
                        engine_generation=self.number, error=f"{type(exc).__name__}: {exc}"[:300], exc_info=True)
            # Some ranks may have been made (or all, and the answer lost): nothing else of this
            # generation exists yet, so whatever carries its name goes before vLLM makes its own.
            try:
                self.workers.ray.kill_actors(self.workers.instance_id(self.number))
            except Exception as kill_exc:  # the agent gone: its actors went with it
                log.warning("could not kill a half-made start's workers", error=str(kill_exc)[:300])
            return None
        log.info("the build's workers start beside its engine core", engine_generation=self.number,
                 replica=self.replica, workers=[w["name"] for w in made], took_s=round(time.monotonic() - started, 2),
                 class_import=self.workers.class_import())
        return self.workers.namespace
