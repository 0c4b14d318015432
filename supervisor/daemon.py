"""The composition root: it builds the parts, runs the owner's loop, and is what readers hold.

Invariants:
* only the owner's dispatch (``supervisor.owner.Owner.dispatch``) changes the daemon's state
  and each replica's; it takes one event at a time from one queue, in the loop here;
* signal handlers, the executor's death events, requests that see an engine die, the probe,
  the cluster watch and the control socket only enqueue events (``post``); so do the tasks of
  slow work when they end (``supervisor.recovery``, ``supervisor.clusterloss``);
* everything that blocks on Ray or builds an engine runs in a worker thread (``builder``);
* readers (the request path, ``/readyz``, the detectors, the status) read the owner's
  immutable ``Snapshot`` (``supervisor.snapshot``).

The parts: the request path (``supervisor.engine_client``), the slow work of starting,
recovering and stopping engine generations (``supervisor.recovery``; one record per recovery
in ``supervisor.record``), the Ray cluster's loss and return (``supervisor.clusterloss``),
operator work (``supervisor.operations``), the warm standby (``supervisor.standby``), the
detectors (``health``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from config import Settings
from health.metrics import SupervisorMetrics
from health.notify import SystemdNotifier, watchdog_loop
from health.clusterwatch import ClusterWatch
from health.deaths import listen_for_worker_deaths
from health.probe import EngineProbe
from supervisor import aio, logs
from supervisor.builder import EngineBuilder
from supervisor.clusterloss import ClusterLoss
from supervisor.detector_view import DetectorView
from supervisor.engine_client import SupervisedEngineClient
from supervisor.events import ControlCommand, EngineFailed, Event, Quarantined, ReloadRequested, SignalReceived
from supervisor.generation import EngineUnavailable, Generation, RequestFailed  # noqa: F401 (re-exported)
from supervisor.owner import Owner, Parts
from supervisor.raylink import RayLink
from supervisor.recovery import Recovery
from supervisor.replica import ReplicaView, pick
from supervisor.routing import PrefixRouter
from supervisor.snapshot import Snapshot
from supervisor.standby import Standby
from supervisor.standby_workers import StandbyWorkers
from supervisor.states import State, StateMachine
from supervisor.suspects import Quarantine

log = logs.get_logger("vllm_supervisor.daemon")


class Supervisor:
    def __init__(self, settings: Settings, engine_args: Any, registry: Any = None, reload_settings: Any = None,
                 control_socket: str | None = None, builder: EngineBuilder | None = None,
                 standby_workers: StandbyWorkers | None = None, early_agent: Any = None):
        """``builder`` (with its ``ray``) and ``standby_workers`` are the parts that reach below
        (vLLM, Ray, the fork server); tests hand in fakes of them. ``early_agent``: the Ray agent
        the command line spawned before it imported vLLM (``supervisor.raylink.early_agent``)."""
        cfg = settings.supervisor
        self.control_socket = control_socket
        self.daemon_id = f"vsup{os.getpid()}x{uuid.uuid4().hex[:6]}"
        self.runtime_dir = Path(os.environ.get("RUNTIME_DIRECTORY") or tempfile.mkdtemp(prefix="vllm-supervisor-"))
        self._own_runtime_dir = "RUNTIME_DIRECTORY" not in os.environ
        self.event_endpoint = f"ipc://{self.runtime_dir}/events-{os.getpid()}.sock"
        if builder is None:
            # the link to the Ray cluster: the agent, placement groups, actor kills
            ray = RayLink(settings.ray, daemon_id=self.daemon_id, shape=lambda: (
                self.builder.engine_args.tensor_parallel_size, self.builder.engine_args.pipeline_parallel_size),
                early=early_agent)
            builder = EngineBuilder(settings, engine_args, self.daemon_id, self.event_endpoint, ray)
        self.builder, self.ray = builder, builder.ray
        if early_agent is not None and not self.builder.uses_ray:  # the mp executor after all: the early agent has nothing to do
            self.ray.drop_early()
        self.metrics = SupervisorMetrics(self.builder.world_size, registry)
        self.notifier = SystemdNotifier()
        # vLLM's own flag: `vllm serve` logs a line per request only with --enable-log-requests
        self.client = SupervisedEngineClient(self, log_requests=lambda: bool(getattr(self.engine_args, "enable_log_requests", False)))
        # The standby prepares one next generation, for whichever replica fails first. Its workers
        # are the V2 executor's: the compiled-graph executor cannot adopt them.
        standby_workers = standby_workers or StandbyWorkers(self.ray, self.builder.instance_id, settings.ray.namespace,
                                                            lambda: self.builder.uses_ray,
                                                            reserve_kv=cfg.standby_kv == "reserved")
        self.standby = Standby(standby_workers, self.metrics, enabled=cfg.standby == "warm"
                               and not getattr(self.builder, "compiled_graph", False))
        # its workers' first creation is the first build's: the agent imports their class ahead (the first
        # agent from its spawn, before the daemon's vLLM import; a later one beside Ray's start)
        self.ray.preload_worker_class = lambda: self.standby.preloads_worker_class
        # where each new request goes between replicas (with one there is no choice to make)
        self.router = PrefixRouter(cfg.routing_slack) if cfg.routing == "prefix" and cfg.replicas > 1 else None
        self.started_monotonic = time.monotonic()
        self.outcomes: Counter[str] = Counter()
        # inputs that crashed two engines, refused at admission (supervisor.suspects)
        self.quarantine = Quarantine(cfg.quarantine_window_s, cfg.quarantine_size)
        c = self.client
        self.metrics.bind_gauges(lambda: c.in_flight, lambda: c.parked, lambda: c.waiting_new)
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self.cluster = ClusterLoss(self.ray, self.standby, self.post, self.metrics,
                                   stopping=lambda: self.state is State.STOPPING)
        self.work = Recovery(self.builder, self.ray, self.standby, self.client, self.cluster, self.post, self.metrics)
        self.owner = Owner(settings, engine_args, Parts(
            work=self.work, cluster=self.cluster, standby=self.standby, ray=self.ray, builder=self.builder,
            client=self.client, metrics=self.metrics, notifier=self.notifier, quarantine=self.quarantine,
            spawn=self.spawn, later=self._later, reload_settings=reload_settings))
        detectors = DetectorView(self.ray, lambda: self.owner.snapshot, lambda: self.owner.cfg, lambda ev: self.post(ev),
                                 self.metrics, self.client)  # all the probe and the cluster watch see of this daemon
        self.probe = EngineProbe(detectors)
        self.clusterwatch = ClusterWatch(detectors)
        self.metrics.set_replicas(cfg.replicas)
        logs.set_context_provider(lambda: {"state": self.state.value, "generation": self.generation_number})

    # --- what readers see: the owner's snapshot ----------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        return self.owner.snapshot

    @property
    def state(self) -> State:
        return self.owner.snapshot.state

    @property
    def reason(self) -> str:
        return self.owner.snapshot.reason

    @property
    def generation_number(self) -> int:
        """The newest generation a replica holds (0: none)."""
        return self.owner.snapshot.generation

    @property
    def replicas(self) -> Sequence[ReplicaView]:
        return self.owner.snapshot.replicas

    @property
    def changed(self) -> asyncio.Event:
        """Pulsed when the snapshot changes."""
        return self.owner.changed

    @property
    def machine(self) -> StateMachine[State]:
        """The daemon's lifecycle (read it; only the owner's dispatch moves it)."""
        return self.owner.machine

    @property
    def settings(self) -> Settings:
        return self.owner.settings

    @property
    def cfg(self) -> Any:
        return self.owner.cfg

    @property
    def exit_code(self) -> int:
        return self.owner.exit_code

    @property
    def restarts(self) -> Counter[str]:
        return self.owner.restarts

    @property
    def engine_args(self) -> Any:
        """The serve Namespace running now (a reload replaces it)."""
        return self.owner.engine_args

    @property
    def api_keys(self) -> list[str]:
        return self.owner.api_keys

    @property
    def config_error(self) -> str:
        """Why the last reload was rejected ("" when it was not)."""
        return self.owner.config_error

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """The closed recovery records, oldest first."""
        return self.owner.records

    @property
    def served_model_name(self) -> str:
        return self.builder.served_model_name

    def pick(self, not_gens: tuple[Generation, ...] = (), parked: bool = False,
             token_ids: Any = None, replica: int | None = None) -> Generation | None:
        """The generation a request (of prompt ``token_ids``, when known) goes to now
        (``supervisor.replica.pick``), none of ``not_gens``, built for the engine arguments the
        front serves (a rolling reload); None unless READY (or DRAINING, for a parked request:
        it was admitted before the drain)."""
        snap = self.owner.snapshot
        if snap.state is State.READY or (parked and snap.state is State.DRAINING):
            return pick(snap.replicas, not_gens, self.client.epoch, self.router, token_ids, replica)
        return None

    def serving(self, not_gens: tuple[Generation, ...] = ()) -> bool:
        return self.pick(not_gens) is not None

    def probe_passed(self, replica: int) -> bool:
        return self.probe.passed(replica)

    # --- reports from the request path (``supervisor.dispatch.Dispatcher``) -------------------

    def engine_died(self, gen: Generation, detail: str) -> None:
        self.post(EngineFailed(gen.number, "engine_dead", detail))

    def count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.metrics.requests.labels(outcome).inc()

    def crashed_engines(self, event: Quarantined) -> None:
        self.post(event)

    # --- the owner's loop -------------------------------------------------------------

    def post(self, event: Event) -> None:
        """Enqueue for the owner (from the event loop's thread only)."""
        self._events.put_nowait(event)

    def _later(self, delay_s: float, event: Event) -> None:
        asyncio.get_running_loop().call_later(delay_s, self.post, event)

    def _install_signal_handlers(self) -> dict[int, Any]:
        """Signals only enqueue. (Ray's core worker would install absl's failure handler over
        SIGTERM; it runs in the Ray agent, ``executor.rayagent``, not here.) Returns the
        handlers they replace, put back at exit."""
        loop = asyncio.get_running_loop()
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.post, SignalReceived(signum))
        loop.add_signal_handler(signal.SIGHUP, self.post, ReloadRequested())
        return previous

    async def run(self) -> int:
        from supervisor.control import serve_control

        loop = asyncio.get_running_loop()
        previous = self._install_signal_handlers()
        background = [self.spawn(listen_for_worker_deaths(self.event_endpoint, lambda ev: self.post(ev))),
                      self.spawn(self.probe.run()), self.spawn(self.clusterwatch.run()),
                      self.spawn(watchdog_loop(self.notifier, lambda: self.state is State.STARTING,
                                               lambda: self.state.terminal))]
        if self.control_socket:
            background.append(self.spawn(serve_control(self.control_socket, self.full_status, self._submit)))
        owner = self.owner
        try:
            self.spawn(self.work.prepare())
            while not owner.state.terminal:
                event = await self._events.get()
                try:
                    owner.dispatch(event)
                except Exception as exc:  # one bad event must not stop the loop
                    log.exception("event handler failed", event=type(event).__name__, error=str(exc))
        finally:
            for signum, handler in previous.items():
                loop.remove_signal_handler(signum)
                if handler is not None:
                    signal.signal(signum, handler)
            for task in background:
                task.cancel()
            if self._own_runtime_dir:
                shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return owner.exit_code

    async def _submit(self, cmd: str, args: dict) -> dict[str, Any]:
        future = asyncio.get_running_loop().create_future()
        self.post(ControlCommand(cmd, args, future))
        return await future

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- status ---------------------------------------------------------------------

    def own_dirs(self) -> tuple[Path, ...]:
        """The temporary directories this daemon made, which its stop removes (a crash leaves
        them to the reaper, ``supervisor.crashrecord``)."""
        return (self.runtime_dir,) if self._own_runtime_dir else ()

    def status(self) -> dict[str, Any]:
        c = self.client
        return {
            "state": self.state.value,
            "reason": self.reason,
            "generation": self.generation_number,
            "replicas": [r.status(self.probe.counts.get(r.index, 0)) for r in self.owner.replicas],
            "routing": self.router.status() if self.router is not None else {"policy": "least_streams"},
            "in_flight": c.in_flight,
            "parked": c.parked,
            "admission_queue": c.waiting_new,
            "uptime_s": round(time.monotonic() - self.started_monotonic, 1),
            "model": self.served_model_name,
            "restarts": dict(self.restarts),
            "requests": dict(self.outcomes),
            "recoveries": self.recoveries[-5:],
            "config_error": self.config_error,
            **({"test_held": c.held} if c._test_hooks else {}),
            "probe": self.probe.status(),
            **({"ray": self.cluster.status()} if self.builder.uses_ray else {}),
            "standby": self.standby.status(),
        }

    async def full_status(self) -> dict[str, Any]:
        """``status()`` plus each replica's workers (replica, rank, actor, pid, node) from Ray."""
        out = self.status()
        out["workers"] = []
        for rep in self.replicas:
            if rep.current is None:
                continue
            try:
                workers = await aio.wait_for(asyncio.to_thread(self.ray.workers, rep.current.instance_id), 10)
            except Exception as exc:
                out["workers_error"] = str(exc)
                continue
            out["workers"] += [{"replica": rep.index, **w} for w in workers]
        return out
