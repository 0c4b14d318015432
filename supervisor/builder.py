"""Everything that blocks on Ray or builds an engine: the owner calls these from worker
threads (``asyncio.to_thread``), never on the event loop.

The model, and one engine generation's build and teardown (with the shared-memory rings it
made). The warm standby's fork server and workers are ``supervisor.standby_workers``; the Ray cluster itself (the agent, each replica's
placement group, actor queries and kills) is ``supervisor.raylink``, handed in.

Builds take turns (one lock): on a small machine two engine starts at once only slow each
other, and the shared-memory rings a build leaves are attributed to it by what appeared
while it ran.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from typing import Any

from config import Settings
from supervisor import logs, testhooks
from supervisor.generation import Generation
from supervisor.raylink import RayLink

log = logs.get_logger("vllm_supervisor.builder")


class BuildAbandoned(RuntimeError):
    """A build not started because the daemon is stopping."""


class EngineBuilder:
    def __init__(self, settings: Settings, engine_args: Any, daemon_id: str, event_endpoint: str, ray: RayLink):
        self.settings = settings
        self.engine_args = engine_args  # vLLM's serve Namespace (``config.serve_args``)
        self.daemon_id = daemon_id
        self.event_endpoint = event_endpoint
        self.ray = ray  # the link to the Ray cluster (the composition root builds it)
        self.model_path = ""
        self.served_model_name = ""
        self.config_epoch = 0  # +1 each time a reload changes the engine arguments (Generation.epoch)
        self._building = threading.Lock()
        self._shm_before: dict[int, set[str]] = {}  # generation -> the rings before its build began
        self._shm_owned: dict[int, set[str]] = {}  # generation -> the rings its build made (until torn down)
        self._shm_at_build_start: set[str] | None = None  # while a build runs: the rings before it began
        self._cores_at_build_start: set[int] | None = None  # while a build runs: the engine cores before it began
        self.abandoned = False  # the daemon is stopping: no build starts, the one under way is cut short
        self._building_number: int | None = None  # the generation being built (holding the lock)
        self.cut_short: set[int] = set()  # generations whose build the stop cut short
        self._replica_metrics: Any = None  # executor.replica_metrics.ReplicaMetrics, with replicas
        # rings of torn-down generations still mapped when their teardown stopped waiting: a
        # worker that has not exited (stopped, or on a partitioned host); swept once unmapped
        self._shm_deferred: set[str] = set()
        # the ZeroMQ socket files each generation's build made (``executor.ipc``), and those of
        # torn-down generations still bound: by a worker not yet exited, or by this process
        # until the old engine is collected (``sweep_sockets`` then)
        self._ipc_owned: dict[int, set[str]] = {}
        self._ipc_deferred: set[str] = set()
        self._stores_owned: dict[int, set[str]] = {}  # each generation's torch file store (``mp``)
        self._sweeping = threading.Lock()  # the sockets' sweeps come from several threads

    @property
    def world_size(self) -> int:
        a = self.engine_args
        return a.tensor_parallel_size * a.pipeline_parallel_size

    @property
    def uses_ray(self) -> bool:
        return self.engine_args.distributed_executor_backend != "mp"

    @property
    def compiled_graph(self) -> bool:
        """vLLM's older compiled-graph Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``)."""
        from executor.engine import uses_compiled_graph

        return self.uses_ray and uses_compiled_graph()

    def instance_id(self, number: int) -> str:
        return f"{self.daemon_id}-g{number}"

    def prepare_model(self) -> None:
        """The demo model is built locally when no model is named (no hub download)."""
        a = self.engine_args
        if a.model:
            self.model_path = a.model
            self.served_model_name = (a.served_model_name or [a.model])[0]
            return
        from supervisor.demo_model import build_demo_model

        started = time.monotonic()
        self.model_path = a.model = str(build_demo_model(self.settings.supervisor.data_dir))
        self.served_model_name = (a.served_model_name or ["demo-tiny-llama"])[0]
        a.served_model_name = [self.served_model_name]
        log.warning("no model configured: serving the built-in demo model; its outputs are random noise",
                    model_path=self.model_path, build_s=round(time.monotonic() - started, 2))

    def _metrics_logger(self, replica: int) -> Any:
        """With replicas: the stand-in through which replica ``replica``'s engine reports to the
        one set of ``vllm:*`` metrics all replicas share (``executor.replica_metrics``)."""
        if self.settings.supervisor.replicas < 2:
            return None
        if self._replica_metrics is None:
            from executor.replica_metrics import ReplicaMetrics

            self._replica_metrics = ReplicaMetrics(self.settings.supervisor.replicas)
        return self._replica_metrics.factory(replica)

    def build(self, number: int, standby: dict[str, Any] | None = None, replica: int = 0,
              start_workers: Any = None) -> Generation:
        """Build generation ``number`` of ``replica``; ``standby`` (``Standby.claim``'s answer)
        says what it may adopt: the fork server for its engine core, standby workers from a
        namespace. Without standby workers, ``start_workers`` (``Standby.starter``) starts the
        build's own beside its engine core (``executor.engine.build_engine`` decides)."""
        from executor.engine import EngineSpec, build_engine, engine_cores_under
        from executor.ipc import socket_files, store_files, sweep
        from executor.shm import vllm_segments
        from executor.steps import StepClock

        instance_id = self.instance_id(number)
        standby = standby or {}
        epoch = self.config_epoch
        steps = None if testhooks.token_clock_only() else StepClock()
        with self._building:
            if self.abandoned:
                self.cut_short.add(number)
                raise BuildAbandoned(f"generation {number} not built: the daemon is stopping")
            self.sweep_deferred()
            self._building_number = number
            self._cores_at_build_start = engine_cores_under(os.getpid())
            shm_before = self._shm_before[number] = self._shm_at_build_start = vllm_segments()
            ipc_before, stores_before = socket_files(), store_files()
            started = time.monotonic()
            log.info("building engine", engine_generation=number, instance_id=instance_id, replica=replica,
                     standby_workers=bool(standby.get("namespace")), forkserver=bool(standby.get("forkserver")))
            try:
                engine = build_engine(EngineSpec(
                    # a copy: vLLM's config builders mutate what they are given (a reload compares args)
                    args=copy.deepcopy(self.engine_args), generation=number, instance_id=instance_id,
                    event_endpoint=self.event_endpoint, placement_group=self.ray.placement_group(replica),
                    kv_cache_space_gib=self.settings.engine.kv_cache_space_gib,
                    standby_namespace=standby.get("namespace"), use_forkserver=bool(standby.get("forkserver")),
                    start_workers=start_workers,
                    step_clock=steps, metrics_logger=self._metrics_logger(replica),
                    replicas=self.settings.supervisor.replicas, replica=replica,
                ))
                self._shm_owned[number] = vllm_segments() - shm_before
            finally:
                self._ipc_owned[number] = socket_files() - ipc_before  # a failed build's too
                self._stores_owned[number] = store_files() - stores_before
                self._shm_at_build_start = self._cores_at_build_start = self._building_number = None
            # the start-up hand-shake's socket is closed once the engine is up: its file goes now
            self._ipc_owned[number] = sweep(self._ipc_owned[number])[1]
        build_s = time.monotonic() - started
        log.info("engine up", engine_generation=number, replica=replica, build_s=round(build_s, 2))
        from executor.engine import is_cpu_platform

        cfg = self.settings.supervisor
        return Generation(number, instance_id, engine, shm_before, build_s, replica=replica, epoch=epoch, steps=steps,
                          first_steps=cfg.hang_first_steps, first_steps_timeout_s=cfg.first_steps_timeout(is_cpu_platform()),
                          local_procs=self.local_procs(engine, instance_id))

    def local_procs(self, engine: Any, instance_id: str) -> list[tuple[int, int | None]]:
        """The engine's processes on this host, (pid, start time): its engine core, and its
        workers (the ``mp`` executor's children, or the Ray actors on this node). Asked once,
        here, off the event loop: the probe reads only ``/proc`` of these (``health.starvation``),
        and the start time keeps it from reading another process on a pid reused since."""
        from executor.procfs import start_time

        procs = [(pid, start) for pid in self._local_pids(engine, instance_id) if (start := start_time(pid)) is not None]
        log.info("engine's processes on this host", pids=[pid for pid, _ in procs])
        return procs

    def _local_pids(self, engine: Any, instance_id: str) -> list[int]:
        from executor.engine import engine_core_pids, engine_worker_pids
        from executor.procfs import read

        pids = engine_core_pids(engine)
        try:
            if not self.uses_ray:
                return pids + engine_worker_pids(engine)
            node = self.ray.call("node_id")
            # a Ray worker's process title starts with "ray::": a pid of another host's worker
            # that names a process here too is not taken for it
            return pids + [w["pid"] for w in self.ray.workers(instance_id) if w.get("pid") and w.get("node_id") == node
                           and (read(w["pid"], "cmdline") or b"").startswith(b"ray::")]
        except Exception as exc:  # the starvation check then reads the engine core alone
            log.warning("could not list the engine's workers on this host", error=f"{type(exc).__name__}: {exc}")
            return pids

    def abandon_builds(self, wait_s: float = 120.0) -> list[int]:
        """The stop waits for no engine start (systemd's stop timeout is the drain's plus a
        minute; an engine start that hangs, on a worker that never answers or a Ray cluster
        gone, would hold it for vLLM's start-up timeout): no build starts from now on, and the
        engine core of the one under way is killed with its children (again, if it starts, or
        takes vLLM's title, only after this call), so vLLM's start-up hand-shake fails at once
        and the build's own failure path cleans up. Returns the PIDs killed."""
        from executor.engine import engine_cores_under, kill_pids, with_descendants

        self.abandoned = True
        killed: list[int] = []
        deadline = time.monotonic() + wait_s
        # while a build holds the lock: one that took it just before ``abandoned`` was set may
        # not have listed the engine cores before it yet
        while self._building.locked() and time.monotonic() < deadline:
            before, number = self._cores_at_build_start, self._building_number
            if before is not None and (new := engine_cores_under(os.getpid()) - before - set(killed)):
                killed += kill_pids(with_descendants(new))
                if number is not None:
                    self.cut_short.add(number)
            time.sleep(0.2)
        return killed

    def front(self, engine: Any) -> tuple[Any, Any]:
        """The request path's own renderer and input processor (they outlive ``engine``)."""
        from executor.engine import frontend_for

        return frontend_for(engine.vllm_config)

    def cleanup_failed_build(self, number: int) -> None:
        """A build that raised may have left actors and rings; unmapped rings only are removed."""
        from executor.ipc import remove
        from executor.shm import sweep

        self.ray.kill_actors(self.instance_id(number))
        remove(self._stores_owned.pop(number, set()))  # its file store: nothing meets through it any more
        self._shm_owned.pop(number, None)
        self._sweep_sockets(self._ipc_owned.pop(number, set()))  # those still bound: by a later sweep
        rings = self._rings_of(self._shm_before.pop(number, None))
        # those still mapped (a killed worker not yet exited) are swept once unmapped: by the
        # next build or teardown, or the stop's last sweep
        self._shm_deferred |= rings - set(sweep(rings))

    def _rings_of(self, before: set[str] | None) -> set[str]:
        """The rings made since ``before`` that are not another generation's: neither a
        built one's (``_shm_owned``) nor the build running now's (made after it began)."""
        from executor.shm import vllm_segments

        if before is None:
            return set()
        rings = vllm_segments() - before - set().union(*self._shm_owned.values())
        if (building := self._shm_at_build_start) is not None:
            rings &= building
        return rings

    def teardown(self, gen: Generation) -> None:
        from executor.engine import engine_core_pids, engine_worker_pids, kill_pids, shutdown_engine
        from executor.ipc import remove
        from executor.procfs import running
        from executor.shm import forget_gone, sweep

        started = time.monotonic()
        local_workers = [] if self.ray.cluster else engine_worker_pids(gen.engine)  # before their parent goes
        cores = engine_core_pids(gen.engine)
        failed = gen.failed and not gen.planned
        failed_cores: list[int] = []
        try:
            # A failed engine core is not waited for: SIGKILL, then vLLM's shutdown finds it gone.
            # (It never exited within vLLM's 1 s default here: its exit waits on Ray's own
            # shutdown; that second was a third of a recovery with the warm standby. Given
            # 0.25 s after SIGTERM it was killed at the end of them: the 0.25 s were the teardown.)
            # Its workers and rings are this teardown's work below in either case.
            failed_cores = kill_pids([p for p in cores if running(p)]) if failed else []
            shutdown_engine(gen.engine, timeout_s=0.25 if failed else 5.0)
        except Exception:
            log.exception("engine shutdown raised", engine_generation=gen.number)
        # vLLM signals only an engine core it believes alive: one whose fork server died looks
        # dead (its exit status came through the server) and is still running.
        stray_cores = kill_pids([p for p in cores if running(p)])
        killed = self.ray.kill_actors(gen.instance_id) if self.ray.cluster else kill_pids(local_workers)
        # its workers are killed: their file store (``mp``) has no user left to remove it
        stores = remove(self._stores_owned.pop(gen.number, set()))
        # Killed workers may take a moment to exit and unmap their rings. Rings that other
        # generations (replicas) made since this one's build began are theirs.
        owned = self._shm_owned.pop(gen.number, None) or set()
        self._shm_before.pop(gen.number, None)
        removed: list[str] = []
        # Killed workers take a moment to exit and unmap them; one on a host this one cannot
        # reach (a partition) will not exit before the link is back: not waited for, its rings
        # are swept once unmapped (``sweep_deferred``), off the recovery's critical path.
        cut_off = self.ray.cut_off(gen.replica) if self.ray.cluster else []
        deadline = time.monotonic() + (0.0 if cut_off else 10.0)
        while True:
            removed += sweep(self._rings_of(gen.shm_before))
            if not self._rings_of(gen.shm_before) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if still := self._rings_of(gen.shm_before):
            self._shm_deferred |= still
            log.warning("rings still mapped after the teardown: swept once unmapped", engine_generation=gen.number,
                        rings=sorted(still), unreachable=cut_off)
        # its socket files, with the earlier ones: those still bound go with ``sweep_sockets``,
        # after the old engine's release
        rings, sockets = self._sweep_deferred(more_sockets=self._ipc_owned.pop(gen.number, set()))
        removed += rings
        forgotten = forget_gone(owned - set(removed))  # unlinked by the engine core itself
        log.info("engine torn down", engine_generation=gen.number, leftover_actors_killed=killed, failed_cores_killed=failed_cores,
                 stray_engine_cores=stray_cores, shm_removed=removed, shm_forgotten=forgotten, sockets_removed=len(sockets),
                 stores_removed=len(stores), took_s=round(time.monotonic() - started, 2))

    def _sweep_sockets(self, more: set[str] = frozenset()) -> list[str]:
        """Remove the ZeroMQ socket files of torn-down generations (and ``more``) that no
        live process has bound any more; the rest stay deferred."""
        from executor.ipc import sweep

        with self._sweeping:
            removed, self._ipc_deferred = sweep(self._ipc_deferred | more)
        return removed

    def sweep_sockets(self, wait_s: float = 10.0) -> list[str]:
        """Once a torn-down engine was collected (``Recovery``, off the critical path): its
        socket files, as their last holders let go (this process's client sockets went with
        the collection; a killed worker's go when it has exited), for up to ``wait_s``."""
        removed: list[str] = []
        deadline = time.monotonic() + wait_s
        while True:
            removed += self._sweep_sockets()
            if not self._ipc_deferred or self.abandoned or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if removed:
            log.info("socket files of an earlier generation removed", count=len(removed))
        return removed

    def sweep_deferred(self, wait_s: float = 0.0) -> list[str]:
        """Remove the rings of torn-down generations that nothing maps any more (their last
        worker exited: killed after a partition healed, say), and the socket files nothing
        binds any more; returns the rings removed. Each build calls it, and the stop, which
        waits up to ``wait_s`` for them (the daemon's last chance: a worker killed at the stop
        may take seconds to exit on a loaded host)."""
        rings, sockets = self._sweep_deferred(wait_s)
        if sockets:
            log.info("socket files of an earlier generation removed", count=len(sockets))
        return rings

    def _sweep_deferred(self, wait_s: float = 0.0, more_sockets: set[str] = frozenset()) -> tuple[list[str], list[str]]:
        """``sweep_deferred``, and a teardown's own socket files (``more_sockets``) in the same
        pass; returns the rings and the socket files removed."""
        from executor.shm import sweep, vllm_segments

        removed: list[str] = []
        deadline = time.monotonic() + wait_s
        while self._shm_deferred:
            self._shm_deferred &= vllm_segments()
            removed += sweep(set(self._shm_deferred))
            self._shm_deferred -= set(removed)
            if not self._shm_deferred or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if removed:
            log.info("rings of an earlier generation removed", rings=removed)
        if self._shm_deferred and wait_s:
            log.warning("rings still mapped at the stop: left in /dev/shm", rings=sorted(self._shm_deferred))
        # after the rings' wait: the workers have exited
        sockets = self._sweep_sockets(more_sockets) if self._ipc_deferred or more_sockets else []
        return removed, sockets

    def kill_stuck_workers(self, gen: Generation) -> None:
        from executor.engine import kill_engine_workers

        killed = self.ray.kill_actors(gen.instance_id) if self.ray.cluster else kill_engine_workers(gen.engine)
        log.warning("killed stuck workers", killed=killed)
