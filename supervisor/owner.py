"""The owner: the daemon's state and the one dispatch that changes it.

``Owner.dispatch`` takes one event at a time (``supervisor.events``: inputs from signals,
detectors, requests and the control socket; results of the owner's own slow work) and is
the only code that moves the daemon's lifecycle (``State``) or a replica's
(``ReplicaState``), both tables in ``supervisor.states``. It never awaits: slow work
(drain, teardown, placement, build, the cluster's return, the stop) starts as a task
(``supervisor.recovery``, ``supervisor.clusterloss``, ``supervisor.operations``) that posts
its result back. After each event the owner publishes an immutable ``Snapshot`` for readers.

One worker death, as events (``docs/architecture.md``):
``EngineFailed`` (replica SERVING → TEARING_DOWN; daemon READY → RECOVERING when no other
replica serves), ``TeardownBegan``, ``TeardownFinished`` (→ PLACING, under the restart
budget, else WAITING), ``Placed`` (→ BUILDING, a generation number taken),
``BuildFinished`` (→ SERVING; daemon → READY; the recovery record closes).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from config import Settings
from config.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_RAY_LOST
from health.metrics import death_cause
from supervisor import logs
from supervisor.events import (
    BuildFinished, ClusterBack, ClusterLost, ControlCommand, Drained, EngineFailed, Placed, Prepared, Quarantined,
    ReloadRequested, RetryDue, SignalReceived, StopDeadline, StopFinished, TeardownBegan, TeardownFinished,
)
from supervisor.operations import kill_worker, plan_reload
from supervisor.policy import RestartIntensity, backoff_s
from supervisor.record import RecoveryRecord
from supervisor.replica import Replica, building, replica_of
from supervisor.snapshot import Snapshot
from supervisor.states import ReplicaState as R, State, StateMachine

if TYPE_CHECKING:
    from health.metrics import SupervisorMetrics
    from health.notify import SystemdNotifier
    from supervisor.builder import EngineBuilder
    from supervisor.clusterloss import ClusterLoss
    from supervisor.engine_client import SupervisedEngineClient
    from supervisor.raylink import RayLink
    from supervisor.recovery import Recovery
    from supervisor.standby import Standby
    from supervisor.suspects import Quarantine

log = logs.get_logger("vllm_supervisor.daemon")


@dataclass
class Rebuild:
    """A planned rebuild of every replica (operator restart, reload), as data: the owner
    takes the targets one at a time once ``drained`` (one replica: after a drain)."""

    reason: str  # operator | reload
    detail: str
    drain: bool
    targets: list[tuple[int, Any]]  # (replica, the generation to rebuild): one recovered since is not rebuilt again
    drained: bool = False
    active: int | None = None  # the replica being rebuilt now


@dataclass
class Stop:
    drained: bool = False  # in-flight requests finished (or the drain's bound passed)
    deadline_set: bool = False  # the wait for work under way is bounded (``StopDeadline``)
    deadline_passed: bool = False  # work under way is no longer waited for
    teardowns: set[int] = field(default_factory=set)  # generations the stop is tearing down
    finishing: bool = False  # the standby's stop and Ray's release are under way


@dataclass
class Parts:
    """What the owner starts work on and reads (``supervisor.daemon`` wires them)."""

    work: Recovery  # the slow work (tasks that post results)
    cluster: ClusterLoss
    standby: Standby  # its own state machine
    ray: RayLink
    builder: EngineBuilder  # the engine arguments and their epoch
    client: SupervisedEngineClient  # in flight, the front's epoch, the holds
    metrics: SupervisorMetrics
    notifier: SystemdNotifier
    quarantine: Quarantine
    spawn: Callable[[Any], Any]  # start a coroutine as a task
    later: Callable[[float, Any], Any]  # post an event after a delay
    reload_settings: Callable[[], tuple[Settings, Any]] | None = None


class Owner:
    def __init__(self, settings: Settings, engine_args: Any, parts: Parts):
        self.settings = settings
        self.engine_args = engine_args  # the serve Namespace running now (a reload replaces it)
        self.api_keys: list[str] = [k for k in (getattr(engine_args, "api_key", None) or []) if k]
        self.config_error = ""  # why the last reload was rejected
        self.p = parts
        cfg = self.cfg
        self.machine: StateMachine[State] = StateMachine()
        self.machine.on_transition.append(self._on_transition)
        self.replicas = [Replica(i, intensity=RestartIntensity(cfg.max_restarts, cfg.restart_window_s))
                         for i in range(cfg.replicas)]
        self.next_generation = 1
        self.doomed: set[int] = set()  # generations that failed while being built: their builds are dropped
        self.records: list[dict[str, Any]] = []  # closed recovery records (``status()["recoveries"]``)
        self.restarts: Counter[str] = Counter()
        self.exit_code = EXIT_OK
        self.preparing = True  # the model and the Ray connection (``Recovery.prepare``)
        self.plan: Rebuild | None = None
        self.stop: Stop | None = None
        self.announce_ready = False  # a reload: tell systemd READY=1 again once it serves
        self._announced_ready = False
        self.changed = asyncio.Event()  # pulsed when the snapshot changes
        self.snapshot = self._take()
        self._handlers: dict[type, Callable[[Any], None]] = {
            SignalReceived: self._on_signal, EngineFailed: self._on_engine_failed, ClusterLost: self._on_cluster_lost,
            ControlCommand: self._on_control, ReloadRequested: self._on_reload, Quarantined: self._on_quarantined,
            Prepared: self._on_prepared, Placed: self._on_placed, BuildFinished: self._on_built,
            TeardownBegan: self._on_teardown_began, TeardownFinished: self._on_torn_down, RetryDue: self._on_retry_due,
            Drained: self._on_drained, StopDeadline: self._on_stop_deadline, ClusterBack: self._on_cluster_back,
            StopFinished: self._on_stop_finished,
        }

    @property
    def cfg(self) -> Any:
        return self.settings.supervisor

    @property
    def state(self) -> State:
        return self.machine.state

    # --- the dispatch -----------------------------------------------------------------

    def dispatch(self, event: Any) -> None:
        """Take one event: its handler, then what follows from the replicas' states (a rebuild's
        next step, the stop's, a replica left waiting alone), then the snapshot."""
        self._handlers[type(event)](event)
        self._settle()
        self._publish()

    def _settle(self) -> None:
        if self.state is State.STOPPING:
            self._settle_stop()
            return
        if self.state.terminal:
            return
        for rep in self.replicas:  # a replica whose budget is spent waits only while another serves or can
            others = [r for r in self.replicas if r is not rep]
            if rep.state is R.WAITING and not any(r.serving() or r.state.busy for r in others):
                self._fail(f"replica {rep.index}: {rep.machine.reason}, and no other replica serves")
                return
        self._settle_plan()

    # --- failures -----------------------------------------------------------------

    def _on_engine_failed(self, event: EngineFailed) -> None:
        if building(self.replicas, event.generation) is not None:
            log.error("engine failed while starting", failed_generation=event.generation, cause=event.reason,
                      detail=event.detail)
            self.doomed.add(event.generation)
            return
        if self._adds_evidence(event):
            return
        rep = replica_of(self.replicas, event.generation)
        if rep is None or rep.current.failed or rep.state is not R.SERVING:
            log.info("ignoring failure of a retired generation", failed_generation=event.generation, cause=event.reason)
            return
        if self.state is State.STOPPING:
            return
        if event.reason == "worker_death":
            self._worker_death_seen(event, rep)
        log.error("engine failed", cause=event.reason, detail=event.detail[:500], replica=rep.index,
                  detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1))
        self._take_down(rep, event, f"{event.reason}: {event.detail[:200]}")

    def _take_down(self, rep: Replica, event: EngineFailed, why: str, planned: bool = False) -> None:
        """``rep``'s generation stops serving: its streams are parked (another serving replica
        takes them at once) and its recovery begins with the teardown."""
        gen = rep.current
        gen.failed, gen.planned = True, planned
        rep.record = RecoveryRecord(rep.index, gen.number, event)
        rep.record.phases["detect"] = max(0.0, time.monotonic() - event.detected_monotonic)
        rep.attempt, rep.first = 0, False
        rep.machine.transition(R.TEARING_DOWN, why)
        self.p.metrics.replica(rep.index, up=False, generation=0)
        self._derive(rep, why)
        gen.interrupt_streams()
        self.p.spawn(self.p.work.teardown(rep.index, gen, kill_workers=event.kill_workers))

    def _adds_evidence(self, event: EngineFailed) -> bool:
        """A worker-death report about a generation whose recovery is under way (it lost the
        race to the engine core's death): evidence for that recovery's record."""
        rep = next((r for r in self.replicas if r.record and r.record.from_generation == event.generation), None)
        if rep is None or not rep.record.add_worker_death(event):
            return False
        self._worker_death_seen(event, rep)
        log.info("failure cause refined", cause="worker_death", detail=event.detail[:300])
        return True

    def _on_cluster_lost(self, event: ClusterLost) -> None:
        ray = self.p.ray
        if (ray.cluster_lost or ray.cluster is None or self.state.terminal
                or ray.released or (event.agent_pid is not None and event.agent_pid != ray.agent_pid)):
            return  # a repeat, or a report about an older agent
        timeout = ray.settings.reconnect_timeout_s  # the ray settings of the start (a reload's apply at the next)
        log.error("ray cluster lost", address=event.address, detail=event.detail, reconnect_timeout_s=timeout,
                  detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1))
        ray.mark_lost()  # nothing more is asked of the agent; a task kills it
        self.p.spawn(self.p.cluster.lose(event.detected_monotonic))
        self.doomed.update(r.building for r in self.replicas if r.building is not None)  # their engine cores lost it too
        reason = f"ray cluster lost ({event.address}: {event.detail}); waiting up to {timeout:g} s for it"
        for rep in self.replicas:  # a recovery under way from a death the loss explains
            before = rep.record.reason if rep.record is not None else None
            if rep.record is not None and rep.record.add_cluster_lost(event.detected_monotonic, reason):
                log.info("failure cause refined", cause="ray_lost", replica=rep.index, refined_from=before)
        serving = [r.current for r in self.replicas if r.serving()]
        for gen in serving:
            self._on_engine_failed(EngineFailed(gen.number, "ray_lost", reason, event.detected_monotonic))
        if not serving and self.state is State.RECOVERING:
            self.machine.transition(State.RECOVERING, reason)

    def _on_cluster_back(self, event: ClusterBack) -> None:
        if self.state is State.RECOVERING:
            self.machine.transition(State.RECOVERING, f"ray cluster back after {event.lost_for_s:.1f} s; rebuilding")

    def _on_quarantined(self, event: Quarantined) -> None:
        """A request crashed the engines of ``event.generations``: its input is refused from
        now on, and that crash loop spends one restart of its replica's budget, not one each."""
        self.p.quarantine.add(event.fingerprint)
        self.p.metrics.quarantined.inc()
        self.replicas[event.replica].intensity.forgive(len(event.generations) - 1)
        log.error("request quarantined: it crashed two engines", request_id=event.request_id,
                  input_fingerprint=event.fingerprint, generations=list(event.generations), replica=event.replica)

    # --- starting and recovering: the results of the slow work -----------------------------

    def _on_prepared(self, event: Prepared) -> None:
        self.preparing = False
        if self.state is State.STOPPING:
            return
        if event.error:
            self._fail(event.error)
            return
        for rep in self.replicas:
            self._attempt(rep)

    def _attempt(self, rep: Replica) -> None:
        """``rep``'s next build attempt, under its restart budget (its first build is free),
        after a backoff that grows with the attempts since it last served or failed."""
        cfg = self.cfg
        if not (rep.first and rep.attempt == 0) and not rep.intensity.record():
            spent = f"restart intensity exceeded: more than {cfg.max_restarts} restarts in {cfg.restart_window_s:g} s"
            if len(self.replicas) == 1:
                rep.machine.transition(R.STOPPED, spent)
                self._fail(spent)
                return
            self._wait_for_budget(rep, spent)
            return
        delay = backoff_s(rep.attempt, cfg.restart_backoff_initial_s, cfg.restart_backoff_max_s)
        rep.attempt += 1
        rep.machine.transition(R.PLACING, f"attempt {rep.attempt}")
        self.p.spawn(self.p.work.place(rep.index, delay))

    def _wait_for_budget(self, rep: Replica, spent: str) -> None:
        """``rep``'s restart budget is spent: it waits (WAITING) until the budget allows one more
        restart, while another replica serves or is on its way up (``_settle`` fails the daemon
        when none is)."""
        free_in = rep.intensity.free_in()
        self.p.later(free_in, RetryDue(rep.index))
        if rep.state is R.WAITING:  # the timer fired a hair early
            return
        rep.retry_at = time.monotonic() + free_in
        rep.machine.transition(R.WAITING, spent)
        self.p.metrics.replica_budget_spent.labels(str(rep.index)).set(1)
        log.error("replica's restart budget spent; the others serve, it waits to retry", replica=rep.index,
                  reason=spent, retry_in_s=round(free_in, 1), last_error=rep.last_error,
                  serving=[r.index for r in self.replicas if r.serving()])
        self.p.notifier.status(f"{self.state.value}: replica {rep.index} waiting: {spent}")

    def _on_retry_due(self, event: RetryDue) -> None:
        rep = self.replicas[event.replica]
        if rep.state is not R.WAITING:
            return
        if rep.intensity.free_in() > 0:
            self._wait_for_budget(rep, rep.machine.reason)
            return
        rep.retry_at = None
        self.p.metrics.replica_budget_spent.labels(str(rep.index)).set(0)
        log.info("replica's restart budget has room again; retrying", replica=rep.index)
        self._attempt(rep)

    def _on_placed(self, event: Placed) -> None:
        rep = self.replicas[event.replica]
        if rep.state is not R.PLACING:
            return  # the stop no longer waits for it
        if rep.record is not None:
            phases = rep.record.phases
            for name, took in event.phases.items():
                phases[name] = phases.get(name, 0.0) + took if name == "ray_reconnect" else took
        if self.state is State.STOPPING:
            rep.machine.transition(R.STOPPED, "stopping")
            return
        if event.fatal:
            rep.machine.transition(R.STOPPED, event.error)
            self._fail(event.error, EXIT_RAY_LOST)
            return
        if event.error:
            self._build_failed(rep, None, event.error)
            if event.capacity and self.state is State.RECOVERING:
                self.machine.transition(State.RECOVERING, f"waiting for capacity: {event.error}")
            self._attempt(rep)
            return
        standby = self.p.standby
        number = standby.reserved()  # the first build placed takes the standby's number, whichever replica
        if number is None:
            number, self.next_generation = self.next_generation, self.next_generation + 1
        standby.take(number)
        rep.building = number
        rep.machine.transition(R.BUILDING, f"building generation {number}")
        reattach = self.p.client.epoch != self.p.builder.config_epoch  # a reload changed the engine arguments
        self.p.spawn(self.p.work.build(rep.index, number, reattach, count_adoption=not (rep.first and rep.attempt == 1)))

    def _on_built(self, event: BuildFinished) -> None:
        rep, gen = self.replicas[event.replica], event.generation
        if rep.building == event.number:
            rep.building = None
        if rep.state is not R.BUILDING:  # the stop stopped waiting for it: only its engine goes
            if gen is not None:
                self.p.spawn(self.p.work.teardown(rep.index, gen, drain=False))
            return
        if rep.record is not None:
            rep.record.phases.update(event.phases)
        if event.error:
            if self.state is State.STOPPING:  # the stop cut it short, or it failed by itself: no restart follows
                rep.last_error = event.error[:300]
                rep.machine.transition(R.STOPPED, "stopping")
            else:
                self._build_failed(rep, event.number, event.error)
                self._attempt(rep)
            return
        if event.number in self.doomed or self.state is State.STOPPING:  # nobody wants it any more
            self.doomed.discard(event.number)
            if self.state is not State.STOPPING:
                self._count_restart("build_failed", rep)
            rep.machine.transition(R.TEARING_DOWN, f"generation {event.number} failed while being built")
            self.p.spawn(self.p.work.teardown(rep.index, gen, drain=False))
            return
        gen.replica = rep.index
        if gen.held_as != self.p.client.holds_now():  # a sleep, wake, pause or resume since its hold
            rep.building = event.number
            self.p.spawn(self.p.work.rehold(rep.index, gen))
            return
        rep.current, rep.served, rep.last_error = gen, True, ""
        verb = "up" if rep.first and rep.attempt == 1 else "recovered"
        rep.first, rep.attempt = False, 0
        rep.machine.transition(R.SERVING, f"generation {event.number} {verb}")
        self.p.metrics.replica(rep.index, up=True, generation=gen.number)
        if rep.record is not None:
            rep.record.standby = gen.standby
        self._derive(rep, f"engine generation {event.number} {verb} in {gen.build_s:.1f} s")
        if self.p.standby.prepare(self.next_generation, gen.engine.vllm_config, rep.index):
            self.next_generation += 1  # reserved for the standby: the next build placed takes it
        self._close_record(rep, ok=True)

    def _build_failed(self, rep: Replica, number: int | None, error: str) -> None:
        rep.last_error = error[:300]
        self._count_restart("build_failed", rep)
        log.error("engine build failed", failed_generation=number, replica=rep.index, error=error[:500])

    def _on_teardown_began(self, event: TeardownBegan) -> None:
        rep = self.replicas[event.replica]
        if rep.record is not None and rep.record.from_generation == event.number:
            rep.record.teardown_monotonic = event.at_monotonic

    def _on_torn_down(self, event: TeardownFinished) -> None:
        rep = self.replicas[event.replica]
        if rep.current is not None and rep.current.number == event.number:
            rep.current = None
        if self.stop is not None:
            self.stop.teardowns.discard(event.number)
        if rep.record is not None and rep.record.from_generation == event.number:
            rep.record.phases.update(event.phases)
        if rep.state is not R.TEARING_DOWN:
            return  # the stop's own teardown
        if self.state is State.STOPPING:
            rep.machine.transition(R.STOPPED, "stopping")
        elif event.error:
            rep.machine.transition(R.STOPPED, event.error)
            self._fail(event.error)
        else:
            self._attempt(rep)

    def _derive(self, rep: Replica, reason: str) -> None:
        """The daemon's state from the replicas': READY while one serves, RECOVERING when none does."""
        why = reason if len(self.replicas) == 1 else f"replica {rep.index}: {reason}"
        serving = [r.index for r in self.replicas if r.serving()]
        if serving and self.state in (State.STARTING, State.RECOVERING):
            self.machine.transition(State.READY, why)
        elif not serving and self.state in (State.READY, State.DRAINING, State.RECOVERING):
            self.machine.transition(State.RECOVERING, why)
        elif rep.serving():
            log.info("replica serving", replica=rep.index, reason=reason)
        elif serving:
            log.warning("replica recovering; the others serve", replica=rep.index, reason=reason[:200], serving=serving)
            self.p.notifier.status(f"{self.state.value}: replica {rep.index} recovering: {reason[:150]}")

    def _close_record(self, rep: Replica, ok: bool) -> None:
        record, rep.record = rep.record, None
        if record is None:
            return
        self._count_restart(record.reason, rep)
        phases = record.phases
        closed = record.close(ok, rep.current.number if rep.current else 0, time.monotonic() - record.opened_monotonic)
        self.records.append(closed)
        if ok:
            self.p.metrics.recovery(rep.index, closed["total_s"] + phases.get("detect", 0.0), phases)
        log.info("recovery finished", ok=ok, **{f"{k}_s": round(v, 3) for k, v in phases.items()},
                 total_s=round(closed["total_s"], 3))

    # --- operators ------------------------------------------------------------------

    def busy(self) -> bool:
        """A start, recovery or planned rebuild is under way."""
        return self.preparing or self.plan is not None or any(r.busy for r in self.replicas)

    def _on_control(self, event: ControlCommand) -> None:
        if not event.reply.done():
            answer = self._control(event.cmd, event.args, event.reply)
            if answer is not None:
                event.reply.set_result(answer)

    def _control(self, cmd: str, args: dict, reply: asyncio.Future) -> dict[str, Any] | None:
        state = self.state
        if cmd == "drain":
            if state is not State.READY:
                return {"ok": False, "error": f"cannot drain while {state.value}"}
            self.machine.transition(State.DRAINING, "operator drain")
            return {"ok": True, "state": self.state.value}
        if cmd == "resume":
            if state is not State.DRAINING or self.busy():
                return {"ok": False, "error": f"nothing to resume while {state.value}"}
            self.machine.transition(State.READY, "operator resume")
            return {"ok": True, "state": self.state.value}
        if cmd == "restart":
            if state not in (State.READY, State.DRAINING) or self.busy():
                return {"ok": False, "error": f"cannot restart while {state.value}"}
            self._begin_rebuild("operator", "operator restart")
            return {"ok": True, "state": self.state.value, "generation": self.snapshot.generation}
        if cmd == "kill-worker":
            rank, index = args["rank"], args.get("replica", 0)
            if index >= len(self.replicas):
                return {"ok": False, "error": f"replica {index} out of range ({len(self.replicas)} replica(s))"}
            gen = self.replicas[index].current
            if gen is None or gen.failed or state is not State.READY:
                return {"ok": False, "error": f"replica {index} has no serving engine (daemon {state.value})"}
            if rank >= self.p.builder.world_size:
                return {"ok": False, "error": f"rank {rank} out of range (world size {self.p.builder.world_size})"}
            if self.p.ray.cluster is None:
                return {"ok": False, "error": "kill-worker needs the ray executor"}
            self.p.spawn(kill_worker(self.p.ray, gen.instance_id, rank, index, gen.number, reply))
            return None
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def _on_reload(self, event: ReloadRequested) -> None:
        """SIGHUP: supervision settings and API keys apply at once; engine changes by a rebuild
        behind a drain; an invalid config keeps the old one running (shown in ``ctl status``)."""
        if self.p.reload_settings is None or self.state not in (State.READY, State.DRAINING) or self.busy():
            log.warning("reload ignored: send SIGHUP again once the recovery or rebuild under way has finished"
                        if self.busy() else "reload ignored", state=self.state.value)
            return
        try:
            plan = plan_reload(self.p.reload_settings, self.settings, self.engine_args)
        except Exception as exc:
            self.config_error = str(exc)
            log.error("reload rejected: keeping the running config", error=self.config_error)
            self.p.notifier.status(f"{self.state.value}: reload rejected: {self.config_error[:200]}")
            return
        self.config_error = ""
        self.settings, self.api_keys = plan.settings, plan.api_keys  # read per request: apply at once
        for rep in self.replicas:
            rep.intensity.max_restarts, rep.intensity.window_s = self.cfg.max_restarts, self.cfg.restart_window_s
        if not plan.changed:
            log.info("config reloaded (no engine change)")
            return
        log.info("config reloaded: engine arguments changed", changed=plan.changed)
        builder = self.p.builder
        self.engine_args = builder.engine_args = plan.engine_args
        builder.settings = plan.settings
        builder.config_epoch += 1  # requests go to the new engines once the front takes their config
        self.p.notifier.reloading()
        self.announce_ready = True
        self._begin_rebuild("reload", f"config reload: {', '.join(plan.changed)[:150]} changed")

    def _begin_rebuild(self, reason: str, detail: str) -> None:
        """A planned rebuild of every replica. One replica: drain (new requests queue), then
        a recovery that continues whatever is still in flight after ``drain_timeout_s``.
        Several: one replica after another, while the others serve."""
        drain = len(self.replicas) == 1
        if drain and self.state is State.READY:
            self.machine.transition(State.DRAINING, detail)
        self.plan = Rebuild(reason, detail, drain, [(rep.index, rep.current) for rep in self.replicas], drained=not drain)
        if drain:
            self.p.spawn(self.p.work.drain("rebuild", self.cfg.drain_timeout_s))

    def _settle_plan(self) -> None:
        plan = self.plan
        if plan is None or not plan.drained:
            return
        while plan.targets:
            index, gen = plan.targets[0]
            rep = self.replicas[index]
            if plan.active == index:
                if rep.busy:
                    return  # its rebuild is under way
                plan.active = None
                plan.targets.pop(0)
                continue
            if not plan.drain and not any(r.serving() for r in self.replicas if r is not rep):
                return  # never take down the last one serving (another may be recovering from a fault)
            if (gen is None or gen is not rep.current or gen.failed or rep.busy
                    or self.state not in (State.READY, State.DRAINING, State.RECOVERING)):
                plan.targets.pop(0)
                continue
            self._take_down(rep, EngineFailed(gen.number, plan.reason, plan.detail), plan.detail, planned=True)
            plan.active = index
            return
        self.plan = None
        if self.announce_ready and self.state is State.READY:  # several replicas: READY all along
            self.announce_ready = False
            self.p.notifier.ready(f"ready (generation {self.snapshot.generation}): {plan.detail[:200]}")

    def _on_drained(self, event: Drained) -> None:
        if event.purpose == "stop" and self.stop is not None:
            self.stop.drained = True
        elif event.purpose == "rebuild" and self.plan is not None:
            if self.state is State.DRAINING:
                self.plan.drained = True
            else:  # a fault or an operator took over meanwhile
                self.plan = None

    # --- stopping -----------------------------------------------------------------

    def _on_signal(self, event: SignalReceived) -> None:
        if self.state is State.STOPPING:
            log.info("stop already in progress", signal=signal.Signals(event.signum).name)
        elif not self.state.terminal:
            self._begin_stop(f"{signal.Signals(event.signum).name} received")

    def _fail(self, reason: str, code: int = EXIT_FAILED) -> None:
        """The daemon gives up (exit ``code``: 3, or 75 when the Ray cluster did not come back):
        the recoveries under way close as failed, then it stops."""
        if self.state is State.STOPPING or self.state.terminal:
            return
        for rep in self.replicas:
            self._close_record(rep, ok=False)
        self.exit_code = code
        self._begin_stop(reason)

    def _begin_stop(self, reason: str) -> None:
        """Stop admitting at once; drain (bounded), wait (bounded) for the work under way, tear
        every replica down, stop the standby and release the cluster; then ``StopFinished``."""
        self.machine.transition(State.STOPPING, reason)
        self.plan = None
        self.stop = Stop()
        self.p.spawn(self.p.work.abandon_builds())  # a build under way is cut short, none starts
        client = self.p.client
        if client.in_flight and self.exit_code == EXIT_OK and any(r.current for r in self.replicas):
            self.p.spawn(self.p.work.drain("stop", self.cfg.drain_timeout_s))
        else:
            self.stop.drained = True

    def _settle_stop(self) -> None:
        stop = self.stop
        if stop is None or not stop.drained or stop.finishing:
            return
        if not stop.deadline_set:
            stop.deadline_set = True
            self.p.later(self.cfg.recovery_timeout_s, StopDeadline())
        for rep in self.replicas:
            idle = rep.state in (R.NEW, R.SERVING, R.WAITING)  # the others finish their work first
            if rep.state is not R.STOPPED and (idle or stop.deadline_passed):
                gen = rep.current if idle else None
                rep.current = None
                if rep.state is R.WAITING:
                    rep.retry_at = None
                    self.p.metrics.replica_budget_spent.labels(str(rep.index)).set(0)
                rep.machine.transition(R.STOPPED, "stopping")
                self.p.metrics.replica(rep.index, up=False, generation=0)
                if gen is not None:
                    gen.interrupt_streams()
                    stop.teardowns.add(gen.number)
                    self.p.spawn(self.p.work.teardown(rep.index, gen, drain=False))
        if all(r.state is R.STOPPED for r in self.replicas) and not stop.teardowns and (
                not self.preparing or stop.deadline_passed):
            stop.finishing = True
            self.p.spawn(self.p.work.finish_stop())

    def _on_stop_deadline(self, event: StopDeadline) -> None:
        if self.stop is not None:
            self.stop.deadline_passed = True

    def _on_stop_finished(self, event: StopFinished) -> None:
        if self.exit_code == EXIT_OK:
            self.machine.transition(State.STOPPED, "stopped")
        else:
            self.machine.transition(State.FAILED, self.machine.reason)

    # --- bookkeeping ------------------------------------------------------------------

    def _count_restart(self, reason: str, rep: Replica) -> None:
        self.restarts[reason] += 1
        self.p.metrics.restarts.labels(str(rep.index), reason).inc()

    def _worker_death_seen(self, event: EngineFailed, rep: Replica) -> None:
        self.p.metrics.worker_deaths.labels(str(rep.index), death_cause(event.detail)).inc()
        self.p.metrics.workers(rep.index, up=False, ranks=event.ranks)

    def _on_transition(self, old: State, new: State, reason: str) -> None:
        log.info("state transition", from_state=old.value, to_state=new.value, reason=reason)
        self.p.metrics.set_state(new.value)
        generation = max((r.current.number for r in self.replicas if r.current is not None), default=0)
        text = f"{new.value} (generation {generation}): {reason[:200]}"
        if new is State.READY and (not self._announced_ready or self.announce_ready):
            self._announced_ready, self.announce_ready = True, False
            self.p.notifier.ready(text)
        elif new is State.STOPPING:
            self.p.notifier.stopping(text)
        else:
            self.p.notifier.status(text)

    def _take(self) -> Snapshot:
        return Snapshot(self.machine.state, self.machine.reason,
                        max((r.current.number for r in self.replicas if r.current is not None), default=0),
                        self.p.builder.config_epoch, tuple(r.view() for r in self.replicas))

    def _publish(self) -> None:
        snapshot = self._take()
        if snapshot.key() != self.snapshot.key():
            self.snapshot = snapshot
            self.changed.set()
