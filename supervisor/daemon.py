"""The lifecycle owner, a composition root: it builds the parts, runs one owner task with one
state machine, and dispatches every event to the part whose job it is.

Invariants:
* only the owner task (``Supervisor.run`` and the handlers it awaits) changes
  ``self.machine`` and what each replica (``self.replicas``) serves;
* signal handlers, the executor's death events, requests that see an engine die, the probe
  and the control socket only enqueue events (``post``);
* everything that blocks on Ray or builds an engine runs in a worker thread (``builder``).

The parts: the request path (``supervisor.engine_client``), starting, recovering and stopping
engine generations (``supervisor.recovery``, one record per recovery in ``supervisor.record``),
the Ray cluster's loss and return (``supervisor.clusterloss``), operator commands and reload
(``supervisor.operations``), the warm standby (``supervisor.standby``), the detectors
(``health``). The parts see the owner through ``supervisor.owner.Owner``.
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
from typing import Any

from config import Settings
from health.metrics import SupervisorMetrics, death_cause
from health.notify import SystemdNotifier, watchdog_loop
from health.clusterwatch import ClusterWatch
from health.deaths import listen_for_worker_deaths
from health.probe import EngineProbe
from supervisor import aio, logs
from supervisor.builder import EngineBuilder
from supervisor.detector_view import DetectorView
from supervisor.engine_client import SupervisedEngineClient
from supervisor.events import (
    ClusterLost, ControlCommand, EngineFailed, Event, Quarantined, RecoveryFinished, ReloadRequested, SignalReceived,
    StopFinished,
)
from supervisor.generation import EngineUnavailable, Generation, RequestFailed  # noqa: F401 (re-exported)
from supervisor.replica import Replica, pick
from supervisor.routing import PrefixRouter
from supervisor.standby import Standby
from supervisor.standby_workers import StandbyWorkers
from supervisor.clusterloss import ClusterLoss
from supervisor.operations import Operations
from supervisor.recovery import EXIT_FAILED, EXIT_OK, EXIT_RAY_LOST, Recovery
from supervisor.states import State, StateMachine
from supervisor.suspects import Quarantine

log = logs.get_logger("vllm_supervisor.daemon")


class Supervisor:
    def __init__(self, settings: Settings, engine_args: Any, registry: Any = None, reload_settings: Any = None,
                 control_socket: str | None = None, builder: EngineBuilder | None = None,
                 standby_workers: StandbyWorkers | None = None):
        """``builder`` and ``standby_workers`` are the parts that reach below (vLLM, Ray, the
        fork server); tests hand in fakes of them."""
        self.settings = settings
        self.cfg = settings.supervisor
        self.control_socket = control_socket
        self.daemon_id = f"vsup{os.getpid()}x{uuid.uuid4().hex[:6]}"
        self.runtime_dir = Path(os.environ.get("RUNTIME_DIRECTORY") or tempfile.mkdtemp(prefix="vllm-supervisor-"))
        self._own_runtime_dir = "RUNTIME_DIRECTORY" not in os.environ
        self.event_endpoint = f"ipc://{self.runtime_dir}/events-{os.getpid()}.sock"
        self.builder = builder or EngineBuilder(settings, engine_args, self.daemon_id, self.event_endpoint)
        self.ray = self.builder.ray  # the link to the Ray cluster (supervisor.raylink)
        self.metrics = SupervisorMetrics(self.builder.world_size, registry)
        self.machine = StateMachine()
        self.machine.on_transition.append(self._on_transition)
        self.notifier = SystemdNotifier()
        self._announced_ready = False
        self.client = SupervisedEngineClient(self)
        detectors = DetectorView(self)  # all the probe and the cluster watch see of this daemon
        self.probe = EngineProbe(detectors)
        self.clusterwatch = ClusterWatch(detectors)
        # The standby prepares one next generation, for whichever replica fails first. Its workers
        # are the V2 executor's: the compiled-graph executor cannot adopt them.
        standby_workers = standby_workers or StandbyWorkers(self.ray, self.builder.instance_id, settings.ray.namespace,
                                                            lambda: self.builder.uses_ray)
        self.standby = Standby(standby_workers, self.metrics, enabled=self.cfg.standby == "warm"
                               and not getattr(self.builder, "compiled_graph", False))
        # where each new request goes between replicas (with one there is no choice to make)
        self.router = PrefixRouter() if self.cfg.routing == "prefix" and self.cfg.replicas > 1 else None
        self.started_monotonic = time.monotonic()
        self.exit_code = EXIT_OK
        self.restarts: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        # inputs that crashed two engines, refused at admission (supervisor.suspects)
        self.quarantine = Quarantine(self.cfg.quarantine_window_s, self.cfg.quarantine_size)
        c = self.client
        self.metrics.bind_gauges(lambda: c.in_flight, lambda: c.parked, lambda: c.waiting_new)
        self.changed = asyncio.Event()  # pulsed on every transition
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        # the parts, each with its own job (``supervisor.owner.Owner`` is what they see of this)
        self.recovery = Recovery(self)
        self.replicas: list[Replica] = self.recovery.replicas
        self.cluster = ClusterLoss(self)
        self.operations = Operations(self, engine_args, reload_settings)
        self.metrics.set_replicas(self.cfg.replicas)
        logs.set_context_provider(lambda: {"state": self.machine.state.value, "generation": self.generation_number})

    # --- read-only views (any task) -------------------------------------------------

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def reason(self) -> str:
        return self.machine.reason

    @property
    def generation_number(self) -> int:
        """The newest generation a replica holds (0: none)."""
        return max((r.current.number for r in self.replicas if r.current is not None), default=0)

    @property
    def engine_args(self) -> Any:
        """The serve Namespace running now (a reload replaces it)."""
        return self.operations.engine_args

    @property
    def api_keys(self) -> list[str]:
        return self.operations.api_keys

    @property
    def config_error(self) -> str:
        """Why the last reload was rejected ("" when it was not)."""
        return self.operations.config_error

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """The closed recovery records, oldest first."""
        return self.recovery.records

    @property
    def served_model_name(self) -> str:
        return self.builder.served_model_name

    def pick(self, not_gen: Generation | None = None, parked: bool = False,
             token_ids: Any = None, replica: int | None = None) -> Generation | None:
        """The generation a request (of prompt ``token_ids``, when known) goes to now
        (``supervisor.replica.pick``), other than ``not_gen``, built for the engine arguments the
        front serves (a rolling reload); None unless READY (or DRAINING, for a parked request:
        it was admitted before the drain)."""
        if self.state is State.READY or (parked and self.state is State.DRAINING):
            return pick(self.replicas, not_gen, self.client.epoch, self.router, token_ids, replica)
        return None

    def serving(self, not_gen: Generation | None = None) -> bool:
        return self.pick(not_gen) is not None

    # --- for the request path (``supervisor.dispatch.Dispatcher``) ------------------------

    def engine_died(self, gen: Generation, detail: str) -> None:
        self.post(EngineFailed(gen.number, "engine_dead", detail))

    def count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.metrics.requests.labels(outcome).inc()

    def crashed_engines(self, event: Quarantined) -> None:
        self.post(event)

    def _on_quarantined(self, event: Quarantined) -> None:
        """A request crashed the engines of ``event.generations``: its input is refused from
        now on, and that crash loop spends one restart of its replica's budget, not one each."""
        self.quarantine.add(event.fingerprint)
        self.metrics.quarantined.inc()
        self.replicas[event.replica].intensity.forgive(len(event.generations) - 1)
        log.error("request quarantined: it crashed two engines", request_id=event.request_id,
                  input_fingerprint=event.fingerprint, generations=list(event.generations), replica=event.replica)

    # --- the owner task ---------------------------------------------------------------

    def post(self, event: Event) -> None:
        """Enqueue for the owner task (from the event loop's thread only)."""
        self._events.put_nowait(event)

    def _install_signal_handlers(self) -> None:
        """Signals only enqueue. (Ray's core worker would install absl's failure handler over
        SIGTERM; it runs in the Ray agent, ``executor.rayagent``, not here.)"""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
            loop.add_signal_handler(signum, self.post, SignalReceived(signum))
        loop.remove_signal_handler(signal.SIGHUP)
        loop.add_signal_handler(signal.SIGHUP, self.post, ReloadRequested())

    async def run(self) -> int:
        from supervisor.control import serve_control

        loop = asyncio.get_running_loop()
        self._install_signal_handlers()
        background = [self.spawn(listen_for_worker_deaths(self.event_endpoint, lambda ev: self.post(ev))),
                      self.spawn(self.probe.run()), self.spawn(self.clusterwatch.run()),
                      self.spawn(watchdog_loop(self.notifier, lambda: self.state is State.STARTING,
                                               lambda: self.state.terminal))]
        if self.control_socket:
            background.append(self.spawn(serve_control(self.control_socket, self.full_status, self._submit)))
        try:
            self.operations.operation = self.spawn(self.recovery.start())
            while not self.state.terminal:
                event = await self._events.get()
                try:
                    await self._handle(event)
                except Exception as exc:  # one bad event must not stop the loop
                    log.exception("event handler failed", event=type(event).__name__, error=str(exc))
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)
            for task in background:
                task.cancel()
            if self._own_runtime_dir:
                shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return self.exit_code

    async def _handle(self, event: Event) -> None:
        if isinstance(event, SignalReceived):
            if self.state is State.STOPPING:
                log.info("stop already in progress", signal=signal.Signals(event.signum).name)
            else:
                self._begin_stop(f"{signal.Signals(event.signum).name} received")
        elif isinstance(event, EngineFailed):
            self.recovery.on_engine_failed(event)
        elif isinstance(event, ClusterLost):
            await self.cluster.on_lost(event)
        elif isinstance(event, RecoveryFinished):
            if not event.ok and self.state is not State.STOPPING:
                self.exit_code = EXIT_RAY_LOST if self.ray.cluster_lost else EXIT_FAILED
                self._begin_stop(event.detail)
        elif isinstance(event, ControlCommand):
            if not event.reply.done():
                event.reply.set_result(await self.operations.on_control(event.cmd, event.args))
        elif isinstance(event, ReloadRequested):
            self.operations.on_reload()
        elif isinstance(event, Quarantined):
            self._on_quarantined(event)
        elif isinstance(event, StopFinished):
            if self.exit_code == EXIT_OK:
                self.machine.transition(State.STOPPED, "stopped")
            else:
                self.machine.transition(State.FAILED, self.machine.reason)

    async def _submit(self, cmd: str, args: dict) -> dict[str, Any]:
        future = asyncio.get_running_loop().create_future()
        self.post(ControlCommand(cmd, args, future))
        return await future

    # --- helpers ------------------------------------------------------------------

    def _begin_stop(self, reason: str) -> None:
        """Stop admitting at once; drain, tear down and report ``StopFinished``."""
        self.machine.transition(State.STOPPING, reason)
        self.spawn(self.recovery.stop(self.operations.operation))

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def count_restart(self, reason: str, rep: Any) -> None:
        self.restarts[reason] += 1
        self.metrics.restarts.labels(str(rep.index), reason).inc()

    def worker_death_seen(self, event: EngineFailed, rep: Any) -> None:
        self.metrics.worker_deaths.labels(str(rep.index), death_cause(event.detail)).inc()
        self.metrics.workers(rep.index, up=False, ranks=event.ranks)

    def _on_transition(self, old: State, new: State, reason: str) -> None:
        log.info("state transition", from_state=old.value, to_state=new.value, reason=reason)
        self.metrics.set_state(new.value)
        text = f"{new.value} (generation {self.generation_number}): {reason[:200]}"
        ops = self.operations
        if new is State.READY and (not self._announced_ready or ops.reloading):
            self._announced_ready, ops.reloading = True, False
            self.notifier.ready(text)
        elif new is State.STOPPING:
            self.notifier.stopping(text)
        else:
            self.notifier.status(text)
        self.changed.set()

    def status(self) -> dict[str, Any]:
        c = self.client
        return {
            "state": self.state.value,
            "reason": self.machine.reason,
            "generation": self.generation_number,
            "replicas": [r.status() for r in self.replicas],
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
