"""The supervisor: one owner task, one state machine, every failure source as one event.

Invariants:
* only the owner task (``Supervisor.run`` and the handlers it awaits) changes
  ``self.machine``, ``self.current`` and ``self._building``;
* signal handlers, the executor's death events, failing requests and the probe only
  enqueue events (``post``);
* everything that blocks on Ray or builds an engine runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from config import Settings
from executor.events import WorkerDeathEvent
from health.metrics import SupervisorMetrics, death_cause
from health.notify import SystemdNotifier
from supervisor import logs
from supervisor.continuation import NotContinuable, SeamText, continuation_params
from supervisor.policy import RestartIntensity, backoff_s
from supervisor.states import State, StateMachine
from supervisor import testhooks

log = logs.get_logger("vllm_supervisor.daemon")

EXIT_OK = 0
EXIT_FAILED = 3  # documented: restart budget exhausted, or the first engine could not start

# --- events for the owner task ---------------------------------------------------------


@dataclass(frozen=True)
class SignalReceived:
    signum: int


@dataclass(frozen=True)
class EngineFailed:
    """Any failure source: worker death, engine dead, probe failure."""

    generation: int
    reason: str  # worker_death | engine_dead | hang | build_failed
    detail: str
    detected_monotonic: float = field(default_factory=time.monotonic)
    kill_workers: bool = False  # a hang: kill the stuck workers before tearing down
    ranks: tuple[int, ...] = ()  # dead worker ranks, when known


@dataclass(frozen=True)
class RecoveryFinished:
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class StopFinished:
    pass


@dataclass(frozen=True)
class ControlCommand:
    """From the control socket; the owner task sets ``reply`` (a future) with the answer."""

    cmd: str
    args: dict
    reply: asyncio.Future


@dataclass(frozen=True)
class ReloadRequested:
    pass


Event = SignalReceived | EngineFailed | RecoveryFinished | StopFinished | ControlCommand | ReloadRequested


class _Interrupted(Exception):
    """The request's engine generation was declared failed while it was running."""


@dataclass
class Generation:
    """One engine and what it owns."""

    number: int
    instance_id: str
    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    shm_before: set[str]
    build_s: float
    # request stream task -> (start time, its output queue)
    pumps: dict[asyncio.Task, tuple[float, asyncio.Queue]] = field(default_factory=dict)
    # cancelled streams still inside AsyncLLM.generate's abort of a dead engine
    lingering: set[asyncio.Task] = field(default_factory=set)
    failed: bool = False

    async def reap_lingering(self, timeout_s: float = 2.0) -> None:
        """After shutdown: a second cancel ends an abort that the dead engine never answers
        (each such task holds the old engine, its zmq sockets and threads)."""
        for task in self.lingering:
            task.cancel()
        if self.lingering:
            await asyncio.wait(self.lingering, timeout=timeout_s)
        self.lingering = {t for t in self.lingering if not t.done()}

    def release(self) -> float:
        """Drop the torn-down engine and collect it now; returns the seconds that took.

        An ``AsyncLLM`` sits in reference cycles with its zmq context (two I/O threads and a
        reaper), sockets and queues; left to the cyclic GC it goes whenever a full collection
        happens to run, so threads and fds drift up over recoveries. One collection per
        recovery (a rare event) returns them at once."""
        self.engine = None
        self.pumps.clear()
        started = time.monotonic()
        gc.collect()
        return time.monotonic() - started

    def interrupt_streams(self) -> None:
        """Park every request of this generation now. The consumer is told directly: a
        cancelled ``AsyncLLM.generate`` awaits an abort that a dead engine never answers."""
        for task, (_start, queue) in list(self.pumps.items()):
            queue.put_nowait(_Interrupted())
            task.cancel()


class EngineUnavailable(Exception):
    """No engine can take the request now (HTTP 503 + Retry-After)."""

    def __init__(self, reason: str, retry_after_s: int = 5):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class RequestFailed(Exception):
    """A request that was in flight cannot be finished; the client should retry it."""


_END = object()


class Supervisor:
    def __init__(self, settings: Settings, registry: Any = None, reload_settings: Any = None,
                 control_socket: str | None = None):
        self.settings = settings
        self._reload_settings = reload_settings  # () -> Settings (raises ConfigError)
        self.control_socket = control_socket
        self.config_error = ""
        self._reloading = False
        self.cfg = settings.supervisor
        self.metrics = SupervisorMetrics(self._world_size(), registry)
        self.machine = StateMachine()
        self.machine.on_transition.append(self._on_transition)
        self.notifier = SystemdNotifier()
        self._announced_ready = False
        self.daemon_id = f"vsup{os.getpid()}x{uuid.uuid4().hex[:6]}"
        self.current: Generation | None = None
        self._building: int | None = None  # generation number being built
        self._doomed: set[int] = set()  # generations that failed while being built
        self.next_generation = 1
        self.started_monotonic = time.monotonic()
        self.exit_code = EXIT_OK
        self.model_path = ""
        self.served_model_name = ""
        self.tokenizer: Any = None
        self.in_flight = 0
        self.waiting_new = 0  # new requests queued for admission
        self.parked = 0  # in-flight requests waiting for the next generation
        self._test_hooks = testhooks.enabled()  # False in production
        self.held = 0  # streams stopped by that hook
        self.last_output_monotonic = time.monotonic()
        self.last_probe_s: float | None = None
        self.last_probe_ok_wall: float | None = None
        self.probe_failures = 0  # consecutive
        self.intensity = RestartIntensity(self.cfg.max_restarts, self.cfg.restart_window_s)
        self.restarts: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.metrics.bind_gauges(lambda: self.in_flight, lambda: self.parked, lambda: self.waiting_new)
        self.recoveries: list[dict[str, Any]] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._changed = asyncio.Event()  # pulsed on every transition
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cluster: Any = None
        self._placement_group: Any = None
        self._shm_before_build: set[str] = set()
        self._reach_check: asyncio.Future | None = None
        self._recovery: asyncio.Task | None = None
        self._active_record: dict[str, Any] | None = None  # the recovery under way
        self._tasks: set[asyncio.Task] = set()
        self.runtime_dir = Path(os.environ.get("RUNTIME_DIRECTORY") or tempfile.mkdtemp(prefix="vllm-supervisor-"))
        self._own_runtime_dir = "RUNTIME_DIRECTORY" not in os.environ
        self.event_endpoint = f"ipc://{self.runtime_dir}/events-{os.getpid()}.sock"
        logs.set_context_provider(lambda: {"state": self.machine.state.value, "generation": self.generation_number})

    # --- read-only views (any task) -------------------------------------------------

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def generation_number(self) -> int:
        return self.current.number if self.current else 0

    # --- requests (called from HTTP handlers) ----------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        """Stream ``RequestOutput`` deltas; across a recovery the stream continues on the
        next engine with prompt + delivered tokens (see ``supervisor.continuation``).

        What the client reads stays exact across the seam: after one, the text and the stop
        strings come from a ``SeamText`` that has seen the original prompt and every
        delivered token; the new engine only supplies token ids."""
        pristine = copy.deepcopy(params)
        delivered: list[int] = []
        delivered_text: list[str] = []
        seam: SeamText | None = None
        hold_after = testhooks.hold_midchar_after(params) if self._test_hooks else None
        attempt = 0
        dead: Generation | None = None  # the generation this request last saw fail
        arrived = last = time.monotonic()
        m = self.metrics
        self.in_flight += 1
        self._idle.clear()
        try:
            while True:
                gen = await self._admit(parked=attempt > 0, not_gen=dead)
                try:
                    sub = params if attempt == 0 else continuation_params(pristine, len(delivered))
                    if delivered and seam is None:
                        seam = SeamText(self._new_detokenizer(prompt_token_ids, pristine, request_id),
                                        delivered, "".join(delivered_text))
                except NotContinuable as exc:
                    self._count_outcome("failed")
                    raise RequestFailed(f"request interrupted by an engine failure and cannot be continued exactly ({exc}); retry it") from None
                rid = request_id if attempt == 0 else f"{request_id}-c{attempt}"
                stream = self._pump(gen, {"prompt_token_ids": prompt_token_ids + delivered}, sub, rid)
                try:
                    async for out in stream:
                        c = out.outputs[0]
                        if seam is not None:
                            c.text, c.token_ids, c.finish_reason, c.stop_reason = seam.step(
                                c.token_ids, c.finish_reason, c.stop_reason)
                            out.prompt_token_ids = prompt_token_ids
                            out.finished = c.finish_reason is not None
                        ids = c.token_ids
                        now = time.monotonic()
                        if not delivered:
                            m.ttft.observe(now - arrived)
                        elif ids:
                            m.itl.observe((now - last) / len(ids))
                        last = now
                        delivered += ids
                        delivered_text.append(c.text)
                        yield out
                        if out.finished:
                            break  # a stop string found across the seam ends the request here
                        if hold_after is not None and attempt == 0:
                            await self._maybe_hold(gen, delivered, hold_after)
                    m.e2e.observe(time.monotonic() - arrived)
                    self._count_outcome("continued" if attempt else "ok")
                    return
                except _Interrupted:
                    pass
                except Exception as exc:
                    if not _is_engine_death(exc, gen):
                        raise
                    self.post(EngineFailed(gen.number, "engine_dead", f"{type(exc).__name__}: {exc}"))
                finally:
                    await stream.aclose()
                dead = gen  # the owner may not have marked it failed yet: never re-admit to it
                attempt += 1
                if attempt > self.cfg.continuation_limit:
                    self._count_outcome("failed")
                    raise RequestFailed(f"request interrupted {attempt} times by engine failures (limit {self.cfg.continuation_limit}); retry it")
                log.info("request parked", request_id=request_id, delivered_tokens=len(delivered), attempt=attempt)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def _new_detokenizer(self, prompt_token_ids: list[int], params: Any, request_id: str) -> Any:
        from executor.engine import new_detokenizer

        return new_detokenizer(self.tokenizer, prompt_token_ids, params, request_id)

    async def _maybe_hold(self, gen: Generation, delivered: list[int], after: int) -> None:
        """Test hook (``supervisor.testhooks``): stop a first-engine stream right after a token
        that ends inside a UTF-8 character, until its engine fails."""
        if len(delivered) < after or not testhooks.ends_mid_character(self.tokenizer, delivered):
            return
        self.held += 1
        try:  # until the engine fails, or the daemon stops (then the stream just goes on)
            while not gen.failed and self.state is not State.STOPPING and not self.state.terminal:
                self._changed.clear()
                await self._changed.wait()
        finally:
            self.held -= 1
        if gen.failed:
            raise _Interrupted()

    async def _pump(self, gen: Generation, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """Run the engine's stream in a task of its own, so a recovery can interrupt it
        (a hung engine never raises by itself)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in gen.engine.generate(prompt, params, request_id):
                    self.last_output_monotonic = time.monotonic()
                    queue.put_nowait(out)
                queue.put_nowait(_END)
            except asyncio.CancelledError:
                queue.put_nowait(_Interrupted())
                raise
            except BaseException as exc:
                queue.put_nowait(exc)

        if gen.failed:
            raise _Interrupted()
        task = asyncio.create_task(pump())
        gen.pumps[task] = (time.monotonic(), queue)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            gen.pumps.pop(task, None)
            if not task.done():
                task.cancel()
                gen.lingering.add(task)
                task.add_done_callback(gen.lingering.discard)

    async def _admit(self, parked: bool, not_gen: Generation | None = None) -> Generation:
        """The current engine once READY (and not ``not_gen``, a generation the request saw
        die before the owner task marked it failed). New requests wait in a bounded queue up
        to ``admission_timeout_s``; parked ones wait up to ``recovery_timeout_s``."""
        if self._serving(not_gen):
            return self.current
        if self.state.terminal or self.state is State.STOPPING:
            if parked:
                self._count_outcome("failed")
                raise RequestFailed(f"daemon is {self.state.value} ({self.machine.reason}); retry the request elsewhere")
            self._count_outcome("rejected")
            raise EngineUnavailable(f"daemon is {self.state.value}: {self.machine.reason}", retry_after_s=30)
        if not parked and self.waiting_new >= self.cfg.admission_queue_size:
            self._count_outcome("rejected")
            raise EngineUnavailable(f"daemon is {self.state.value} and its admission queue is full ({self.cfg.admission_queue_size})")
        timeout = self.cfg.recovery_timeout_s if parked else self.cfg.admission_timeout_s
        deadline = time.monotonic() + timeout
        if parked:
            self.parked += 1
        else:
            self.waiting_new += 1
        try:
            while True:
                if self._serving(not_gen):
                    return self.current
                if self.state.terminal or self.state is State.STOPPING:
                    return await self._admit(parked, not_gen)
                left = deadline - time.monotonic()
                if left <= 0:
                    if parked:
                        self._count_outcome("failed")
                        raise RequestFailed(f"no engine within {timeout:g} s ({self.machine.reason}); retry the request")
                    self._count_outcome("rejected")
                    raise EngineUnavailable(f"daemon is {self.state.value} ({self.machine.reason}); no engine within {timeout:g} s")
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            if parked:
                self.parked -= 1
            else:
                self.waiting_new -= 1

    def _serving(self, not_gen: Generation | None = None) -> bool:
        gen = self.current
        return self.state is State.READY and gen is not None and not gen.failed and gen is not not_gen

    # --- the owner task ---------------------------------------------------------------

    def post(self, event: Event) -> None:
        """Enqueue for the owner task (from the event loop's thread only)."""
        self._events.put_nowait(event)

    def _install_signal_handlers(self) -> None:
        """Signals only enqueue. Re-run after ``ray.init``: Ray's core worker installs
        absl's failure handler over SIGTERM, which aborts the process."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
            loop.add_signal_handler(signum, self.post, SignalReceived(signum))
        loop.remove_signal_handler(signal.SIGHUP)
        loop.add_signal_handler(signal.SIGHUP, self.post, ReloadRequested())

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._install_signal_handlers()
        background = [self._spawn(self._listen_for_worker_deaths()), self._spawn(self._probe_loop()),
                      self._spawn(self._systemd_loop())]
        if self.control_socket:
            background.append(self._spawn(self._control_server(self.control_socket)))
        try:
            self._recovery = self._spawn(self._start())
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
            self._on_engine_failed(event)
        elif isinstance(event, RecoveryFinished):
            self._recovery = None
            if not event.ok and self.state is not State.STOPPING:
                self.exit_code = EXIT_FAILED
                self._begin_stop(event.detail)
        elif isinstance(event, ControlCommand):
            if not event.reply.done():
                event.reply.set_result(await self._on_control(event.cmd, event.args))
        elif isinstance(event, ReloadRequested):
            self._on_reload()
        elif isinstance(event, StopFinished):
            if self.exit_code == EXIT_OK:
                self.machine.transition(State.STOPPED, "stopped")
            else:
                self.machine.transition(State.FAILED, self.machine.reason)

    def _on_engine_failed(self, event: EngineFailed) -> None:
        if event.generation == self._building:
            log.error("engine failed while starting", failed_generation=event.generation, cause=event.reason, detail=event.detail)
            self._doomed.add(event.generation)
            return
        if self._refine_cause(event):
            return
        gen = self.current
        if gen is None or event.generation != gen.number or gen.failed:
            log.info("ignoring failure of a retired generation", failed_generation=event.generation, cause=event.reason)
            return
        if self.state is State.STOPPING:
            return
        gen.failed = True
        if event.reason == "worker_death":
            self.metrics.worker_deaths.labels(death_cause(event.detail)).inc()
            self.metrics.workers(up=False, ranks=event.ranks)
        log.error("engine failed", cause=event.reason, detail=event.detail[:500],
                  detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1))
        self.machine.transition(State.RECOVERING, f"{event.reason}: {event.detail[:200]}")
        gen.interrupt_streams()  # park every in-flight request
        self._begin_record(gen, event)
        self._recovery = self._spawn(self._recover(gen, event))

    def _begin_record(self, old: Generation, event: EngineFailed) -> dict[str, Any]:
        """The record of the recovery from ``old``; open (``_refine_cause`` may still sharpen
        its cause) until the recovery ends."""
        self._active_record = {"reason": event.reason, "detail": event.detail[:300], "from_generation": old.number,
                               "detected_monotonic": event.detected_monotonic, "phases_s": {},
                               # from the whole of Ray's death cause (the detail is cut short)
                               "cause": death_cause(event.detail) if event.reason == "worker_death" else None}
        return self._active_record

    def _refine_cause(self, event: EngineFailed) -> bool:
        """A worker-death report that lost the race to an ``EngineDeadError`` of a request
        (the engine core fails as its worker dies) names the same failure more precisely:
        the recovery under way takes its reason, ranks and cause. Only reports detected
        before that recovery's teardown began (which kills the workers itself) count."""
        rec = self._active_record
        if (event.reason != "worker_death" or rec is None or rec["from_generation"] != event.generation
                or rec["reason"] != "engine_dead" or event.detected_monotonic >= rec.get("teardown_monotonic", float("inf"))):
            return False
        rec.update(reason="worker_death", detail=event.detail[:300], refined_from="engine_dead",
                   cause=death_cause(event.detail))
        self.metrics.worker_deaths.labels(death_cause(event.detail)).inc()
        self.metrics.workers(up=False, ranks=event.ranks)
        log.info("failure cause refined", cause="worker_death", detail=event.detail[:300])
        return True

    # --- operator commands and reload ------------------------------------------------------

    async def _control_server(self, path: str) -> None:
        """JSON over a pyzmq REP socket, 0600. Status is answered here; every other
        command goes to the owner task as a ``ControlCommand``."""
        from supervisor.control import parse_request

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.REP)
        Path(path).unlink(missing_ok=True)
        old_umask = os.umask(0o077)
        try:
            sock.bind(f"ipc://{path}")
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        log.info("control socket listening", path=path)
        try:
            while True:
                raw = await sock.recv()
                try:
                    cmd, args = parse_request(raw)
                    if cmd == "status":
                        reply = {"ok": True, "status": await self.full_status()}
                    else:
                        future = asyncio.get_running_loop().create_future()
                        self.post(ControlCommand(cmd, args, future))
                        reply = await asyncio.wait_for(future, 60)
                except ValueError as exc:
                    reply = {"ok": False, "error": str(exc)}
                except Exception as exc:
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                await sock.send(json.dumps(reply, default=str).encode())
        finally:
            sock.close(linger=0)
            Path(path).unlink(missing_ok=True)

    async def full_status(self) -> dict[str, Any]:
        """``status()`` plus the workers (rank, actor, pid, node) from Ray."""
        out = self.status()
        gen = self.current
        out["workers"] = []
        if gen is not None and self._cluster is not None and hasattr(self._cluster, "workers"):
            try:
                out["workers"] = await asyncio.wait_for(asyncio.to_thread(self._cluster.workers, gen.instance_id), 10)
            except Exception as exc:
                out["workers_error"] = str(exc)
        return out

    async def _on_control(self, cmd: str, args: dict) -> dict[str, Any]:
        if cmd == "drain":
            if self.state is not State.READY:
                return {"ok": False, "error": f"cannot drain while {self.state.value}"}
            self.machine.transition(State.DRAINING, "operator drain")
            return {"ok": True, "state": self.state.value}
        if cmd == "resume":
            if self.state is not State.DRAINING or self._busy():
                return {"ok": False, "error": f"nothing to resume while {self.state.value}"}
            self.machine.transition(State.READY, "operator resume")
            return {"ok": True, "state": self.state.value}
        if cmd == "restart":
            if self.state not in (State.READY, State.DRAINING) or self._busy():
                return {"ok": False, "error": f"cannot restart while {self.state.value}"}
            self._begin_rebuild("operator", "operator restart")
            return {"ok": True, "state": self.state.value, "generation": self.generation_number}
        if cmd == "kill-worker":
            gen = self.current
            rank = args["rank"]
            if gen is None or self.state is not State.READY:
                return {"ok": False, "error": f"no serving engine while {self.state.value}"}
            if rank >= self._world_size():
                return {"ok": False, "error": f"rank {rank} out of range (world size {self._world_size()})"}
            e = self.settings.engine
            killed = await asyncio.to_thread(self._kill_worker, gen.instance_id, rank, e.tensor_parallel_size,
                                             e.pipeline_parallel_size)
            return {"ok": bool(killed), "killed": killed, **({} if killed else {"error": "actor not found"})}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def _kill_worker(self, instance_id: str, rank: int, tp: int, pp: int) -> list[str]:
        from executor.cluster import worker_actor_name

        return self._cluster.kill_actor_exact(worker_actor_name(instance_id, rank, tp, pp))

    def _busy(self) -> bool:
        """A start, recovery or planned rebuild is under way."""
        return self._recovery is not None and not self._recovery.done()

    def _on_reload(self) -> None:
        """SIGHUP: re-read the config. Engine changes are applied by a rebuild behind a
        drain; an invalid config keeps the old one running (shown in ``ctl status``)."""
        if self._reload_settings is None or self.state not in (State.READY, State.DRAINING):
            log.warning("reload ignored", state=self.state.value)
            return
        try:
            new = self._reload_settings()
        except Exception as exc:
            self.config_error = str(exc)
            log.error("reload rejected: keeping the running config", error=self.config_error)
            self.notifier.status(f"{self.state.value}: reload rejected: {self.config_error[:200]}")
            return
        self.config_error = ""
        old, self.settings = self.settings, new
        self.cfg = new.supervisor
        self.intensity.max_restarts, self.intensity.window_s = self.cfg.max_restarts, self.cfg.restart_window_s
        # server.api_key and server.max_body_bytes are read per request: they apply at once.
        if (new.server.host, new.server.port) != (old.server.host, old.server.port) or new.ray != old.ray:
            log.warning("server.host, server.port and ray settings take effect at the next daemon start")
        if new.engine == old.engine:
            log.info("config reloaded (no engine change)")
            return
        self.notifier.reloading()
        self._reloading = True
        self._begin_rebuild("reload", "config reload: engine settings changed")

    def _begin_rebuild(self, reason: str, detail: str) -> None:
        """A planned rebuild: drain (new requests queue), then a recovery that continues
        whatever is still in flight after ``drain_timeout_s``."""
        gen = self.current
        if self.state is State.READY:
            self.machine.transition(State.DRAINING, detail)

        async def drain_then_rebuild() -> None:
            try:
                await asyncio.wait_for(self._idle.wait(), self.cfg.drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("drain deadline passed; continuing the rest on the new engine", in_flight=self.in_flight)
            if gen is not self.current or gen is None or gen.failed or self.state is not State.DRAINING:
                return
            gen.failed = True
            self.machine.transition(State.RECOVERING, detail)
            gen.interrupt_streams()
            await self._recover(gen, EngineFailed(gen.number, reason, detail))

        self._recovery = self._spawn(drain_then_rebuild())

    # --- starting and recovering --------------------------------------------------------

    async def _start(self) -> None:
        try:
            await asyncio.to_thread(self._prepare_model)
            if self.settings.engine.executor == "ray":
                self._cluster = await asyncio.to_thread(self._connect_ray)
                self._install_signal_handlers()
        except Exception as exc:
            log.exception("first start failed")
            self.post(RecoveryFinished(False, f"could not start: {type(exc).__name__}: {exc}"))
            return
        ok, detail = await self._bring_up(first=True)
        self.post(RecoveryFinished(ok, detail))

    async def _recover(self, old: Generation, event: EngineFailed) -> None:
        started = time.monotonic()
        record = self._active_record
        if record is None or record["from_generation"] != old.number:
            record = self._begin_record(old, event)
        phases: dict[str, float] = record["phases_s"]
        phases["detect"] = max(0.0, started - event.detected_monotonic)
        try:
            t = time.monotonic()
            if event.kill_workers:  # a hang: the stuck workers go first (SIGKILL works on stopped ones)
                await asyncio.to_thread(self._kill_stuck_workers, old)
            await self._drain_pumps(old)
            phases["drain"] = time.monotonic() - t
            t = record["teardown_monotonic"] = time.monotonic()
            await asyncio.to_thread(self._teardown_generation, old)
            await old.reap_lingering()
            self.current = None
            phases["teardown"] = time.monotonic() - t
            self._release_soon(old)
            ok, detail = await self._bring_up(first=False, phases=phases)
        except Exception as exc:
            log.exception("recovery failed")
            ok, detail = False, f"recovery failed: {type(exc).__name__}: {exc}"
        finally:  # also when cancelled: the record is closed and the restart counted
            self._active_record = None
            self._count_restart(record["reason"])
        record.update(ok=ok, total_s=time.monotonic() - started, to_generation=self.generation_number,
                      ready_monotonic=time.monotonic())
        self.recoveries.append(record)
        if ok:
            self.metrics.recovery(record["total_s"] + phases["detect"], phases)
        log.info("recovery finished", ok=ok, **{f"{k}_s": round(v, 3) for k, v in phases.items()},
                 total_s=round(record["total_s"], 3))
        self.post(RecoveryFinished(ok, detail))

    async def _bring_up(self, first: bool, phases: dict[str, float] | None = None) -> tuple[bool, str]:
        """Place the workers and build engines until one is up, the restart budget is
        spent, or a stop is requested. Returns (ok, detail)."""
        phases = phases if phases is not None else {}
        attempt = 0
        while True:
            if self.state is State.STOPPING:
                return True, "stopping"
            if not first or attempt > 0:
                if not self.intensity.record():
                    return False, (f"restart intensity exceeded: more than {self.cfg.max_restarts} restarts "
                                   f"in {self.cfg.restart_window_s:g} s")
            delay = backoff_s(attempt, self.cfg.restart_backoff_initial_s, self.cfg.restart_backoff_max_s)
            if delay:
                await asyncio.sleep(delay)
            attempt += 1
            number = self.next_generation
            self.next_generation += 1
            self._building = number
            try:
                t = time.monotonic()
                await asyncio.to_thread(self._ensure_placement_group)
                phases["placement_group"] = time.monotonic() - t
                t = time.monotonic()
                gen = await asyncio.to_thread(self._build_generation, number)
                phases["engine_start"] = time.monotonic() - t
            except Exception as exc:
                self._building = None
                self._count_restart("build_failed")
                log.error("engine build failed", failed_generation=number, error=f"{type(exc).__name__}: {exc}"[:500])
                if type(exc).__name__ == "PlacementGroupTimeout" and self.state is State.RECOVERING:
                    self.machine.transition(State.RECOVERING, f"waiting for capacity: {exc}")
                await asyncio.to_thread(self._cleanup_failed_build, number)
                continue
            self._building = None
            if number in self._doomed or self.state is State.STOPPING:
                self._doomed.discard(number)
                await asyncio.to_thread(self._teardown_generation, gen)
                await gen.reap_lingering()
                self._release_soon(gen)
                if self.state is State.STOPPING:
                    return True, "stopping"
                self._count_restart("build_failed")
                continue
            self.current = gen
            if self.tokenizer is None:
                self.tokenizer = gen.engine.get_tokenizer()
            verb = "up" if first and attempt == 1 else "recovered"
            self.machine.transition(State.READY, f"engine generation {number} {verb} in {gen.build_s:.1f} s")
            return True, ""

    async def _drain_pumps(self, gen: Generation, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until every request stream of ``gen`` has let go of it."""
        deadline = time.monotonic() + timeout_s
        while gen.pumps and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _prepare_model(self) -> None:
        engine = self.settings.engine
        if engine.model:
            self.model_path = engine.model
            self.served_model_name = engine.served_model_name or engine.model
            return
        from supervisor.demo_model import build_demo_model

        started = time.monotonic()
        self.model_path = str(build_demo_model(self.cfg.data_dir))
        self.served_model_name = engine.served_model_name or "demo-tiny-llama"
        log.warning("no model configured: serving the built-in demo model; its outputs are random noise",
                    model_path=self.model_path, build_s=round(time.monotonic() - started, 2))

    def _connect_ray(self) -> Any:
        from executor.cluster import RayCluster

        cluster = RayCluster(self.settings.ray)
        address = cluster.connect()
        log.info("ray connected", address=address, local=cluster.started_local)
        return cluster

    def _world_size(self) -> int:
        e = self.settings.engine
        return e.tensor_parallel_size * e.pipeline_parallel_size

    def _kill_stuck_workers(self, gen: Generation) -> None:
        from executor.engine import kill_engine_workers

        killed = self._kill_actors(gen.instance_id) if self._cluster else kill_engine_workers(gen.engine)
        log.warning("killed stuck workers", killed=killed)

    def _ensure_placement_group(self) -> None:
        """Reuse the placement group while all its bundles are placed, else re-create it."""
        from executor.engine import is_cpu_platform

        if self._cluster is None:  # the mp executor: no Ray, no placement group
            return
        if self._placement_group is not None:
            if self._cluster.placement_group_ready(self._placement_group):
                return
            log.warning("placement group lost bundles; re-creating it")
            self._cluster.remove_placement_group(self._placement_group)
            self._placement_group = None
        device = "CPU" if is_cpu_platform() else "GPU"
        started = time.monotonic()
        self._placement_group = self._cluster.create_placement_group(f"{self.daemon_id}-pg", self._world_size(), device)
        log.info("placement group ready", bundles=self._world_size(), device=device, took_s=round(time.monotonic() - started, 3))

    def _dtype(self) -> str:
        """The demo model runs in float32 (greedy output must not depend on batch layout)."""
        dtype = self.settings.engine.dtype
        if dtype == "auto" and not self.settings.engine.model:
            return "float32"
        return dtype

    def _instance_id(self, number: int) -> str:
        return f"{self.daemon_id}-g{number}"

    def _build_generation(self, number: int) -> Generation:
        from executor.engine import EngineSpec, build_engine
        from executor.shm import vllm_segments

        instance_id = self._instance_id(number)
        shm_before = vllm_segments()
        started = time.monotonic()
        log.info("building engine", engine_generation=number, instance_id=instance_id)
        self._shm_before_build = shm_before
        engine = build_engine(EngineSpec(
            settings=self.settings.engine, model_path=self.model_path, served_model_name=self.served_model_name,
            generation=number, instance_id=instance_id, event_endpoint=self.event_endpoint,
            placement_group=self._placement_group, dtype=self._dtype(),
        ))
        build_s = time.monotonic() - started
        log.info("engine up", engine_generation=number, build_s=round(build_s, 2))
        return Generation(number, instance_id, engine, shm_before, build_s)

    def _cleanup_failed_build(self, number: int) -> None:
        """A build that raised may have left actors and rings; unmapped rings only are removed."""
        from executor.shm import sweep, vllm_segments

        self._kill_actors(self._instance_id(number))
        sweep(vllm_segments() - self._shm_before_build)

    # --- stopping -----------------------------------------------------------------

    def _begin_stop(self, reason: str) -> None:
        """Stop admitting at once; drain, tear down and report ``StopFinished``."""
        self.machine.transition(State.STOPPING, reason)
        self._spawn(self._stop())

    async def _stop(self) -> None:
        try:
            if self.in_flight and self.exit_code == EXIT_OK and self.current is not None:
                timeout = self.cfg.drain_timeout_s
                log.info("draining", in_flight=self.in_flight, timeout_s=timeout)
                try:
                    await asyncio.wait_for(self._idle.wait(), timeout)
                except asyncio.TimeoutError:
                    log.warning("drain deadline passed", in_flight=self.in_flight)
            if self._recovery is not None:  # let an engine build in progress finish, then drop it
                await asyncio.wait({self._recovery}, timeout=self.cfg.recovery_timeout_s)
            gen, self.current = self.current, None
            if gen is not None:
                gen.interrupt_streams()
                await asyncio.to_thread(self._teardown_generation, gen)
                await gen.reap_lingering()
            await asyncio.to_thread(self._release_cluster)
        except Exception:
            log.exception("error while stopping")
        finally:
            self.post(StopFinished())

    def _kill_actors(self, instance_id: str) -> list[str]:
        if self._cluster is None:
            return []
        try:
            return self._cluster.kill_actors_named(f"_{instance_id}")
        except Exception as exc:
            log.warning("could not list/kill actors", error=str(exc))
            return []

    def _release_soon(self, gen: Generation, delay_s: float = 2.0) -> None:
        """Collect a torn-down generation off the recovery's critical path: the full collection
        holds the GIL for a few hundred ms, and ``delay_s`` after the next build started, that
        build is waiting for its engine-core process to import vLLM, not for this process."""

        def release() -> None:
            log.info("old engine released", engine_generation=gen.number, gc_s=round(gen.release(), 3),
                     lingering=len(gen.lingering))

        asyncio.get_running_loop().call_later(delay_s, release)

    def _teardown_generation(self, gen: Generation) -> None:
        from executor.engine import engine_worker_pids, kill_pids, shutdown_engine
        from executor.shm import sweep, vllm_segments

        started = time.monotonic()
        local_workers = [] if self._cluster else engine_worker_pids(gen.engine)  # before their parent goes
        try:
            # A failed engine core is not waited for: 1 s to exit on SIGTERM, then SIGKILL.
            shutdown_engine(gen.engine, timeout_s=1.0 if gen.failed else 5.0)
        except Exception:
            log.exception("engine shutdown raised", engine_generation=gen.number)
        killed = self._kill_actors(gen.instance_id) if self._cluster else kill_pids(local_workers)
        # Killed workers may take a moment to exit and unmap their rings.
        removed: list[str] = []
        deadline = time.monotonic() + 10.0
        while True:
            removed += sweep(vllm_segments() - gen.shm_before)
            if not (vllm_segments() - gen.shm_before) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        log.info("engine torn down", engine_generation=gen.number, leftover_actors_killed=killed,
                 shm_removed=removed, took_s=round(time.monotonic() - started, 2))

    def _release_cluster(self) -> None:
        if self._cluster is None:
            return
        if self._placement_group is not None:
            self._cluster.remove_placement_group(self._placement_group)
            self._placement_group = None
        self._cluster.shutdown()
        log.info("ray released", stopped_local_cluster=self._cluster.started_local)

    # --- failure sources --------------------------------------------------------------

    async def _listen_for_worker_deaths(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.PULL)
        sock.bind(self.event_endpoint)
        os.chmod(self.event_endpoint.removeprefix("ipc://"), 0o600)
        try:
            while True:
                raw = await sock.recv()
                try:
                    ev = WorkerDeathEvent.from_json(raw)
                except (ValueError, TypeError) as exc:
                    log.warning("malformed executor event", error=str(exc))
                    continue
                detail = f"rank(s) {ev.ranks} ({', '.join(ev.actor_names)}): {ev.cause}"
                self.post(EngineFailed(ev.generation, "worker_death", detail, ev.detected_monotonic, ranks=tuple(ev.ranks)))
        finally:
            sock.close(linger=0)

    async def _probe_loop(self) -> None:
        """Engine reported dead, or hung: no token for ``hang_timeout_s`` while busy, or a
        one-token canary slower than ``probe_timeout_s`` while idle. ``probe_failure_threshold``
        consecutive failures make one ``EngineFailed``."""
        failures = 0
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            gen = self.current
            if self.state is not State.READY or gen is None or gen.failed:
                failures = self.probe_failures = 0  # a new generation starts with a clean slate
                continue
            try:
                problem = await self._probe(gen)
            except Exception as exc:
                problem = f"probe error: {type(exc).__name__}: {exc}"
            self.probe_failures = 0 if problem is None else failures + 1
            if problem is None:
                failures = 0
                continue
            if problem.startswith("dead:"):
                self.post(EngineFailed(gen.number, "engine_dead", problem))
                continue
            failures += 1
            log.warning("probe failed", problem=problem, consecutive=failures)
            if failures >= self.cfg.probe_failure_threshold and gen is self.current and not gen.failed:
                failures = 0
                reason = "ray_lost" if problem.startswith("ray cluster") else "hang"
                self.post(EngineFailed(gen.number, reason, problem, kill_workers=True))

    async def _probe(self, gen: Generation) -> str | None:
        if gen.engine.errored:
            return "dead: engine reported errored"
        if self._cluster is not None:
            # At most one check in flight: a GCS that is gone can block the call for a minute.
            if self._reach_check is None or self._reach_check.done():
                self._reach_check = asyncio.ensure_future(asyncio.to_thread(self._cluster.reachable))
            try:
                reachable = await asyncio.wait_for(asyncio.shield(self._reach_check), self.cfg.probe_timeout_s)
            except asyncio.TimeoutError:
                reachable = False
            if not reachable:
                return "ray cluster unreachable"
        now = time.monotonic()
        if gen.pumps:
            # Hung: nothing came out since the later of the last output and the oldest
            # running stream's start (new arrivals cannot hide a hang).
            stalled = now - max(self.last_output_monotonic, min(start for start, _ in gen.pumps.values()))
            if stalled > self.cfg.hang_timeout_s:
                return f"no token for {stalled:.1f} s with {len(gen.pumps)} stream(s) running"
            return None
        if now - self.last_output_monotonic < self.cfg.probe_interval_s:
            return None
        from vllm import SamplingParams

        started = time.monotonic()
        try:
            async with asyncio.timeout(self.cfg.probe_timeout_s):
                async for _ in self._pump(gen, {"prompt_token_ids": [0]}, SamplingParams(max_tokens=1, temperature=0), f"probe-{uuid.uuid4().hex[:8]}"):
                    pass
        except TimeoutError:
            return f"canary generation took longer than {self.cfg.probe_timeout_s:g} s"
        except _Interrupted:
            return None
        self.last_probe_s = time.monotonic() - started
        self.last_probe_ok_wall = time.time()
        self.metrics.probe_latency.observe(self.last_probe_s)
        self.metrics.probe_last_success.set(self.last_probe_ok_wall)
        return None

    async def _systemd_loop(self) -> None:
        """WATCHDOG=1 every WATCHDOG_USEC/2 from the event loop itself (a stuck loop stops
        them) and only while not FAILED; EXTEND_TIMEOUT_USEC while the first engine starts."""
        if not self.notifier.enabled:
            return
        interval = self.notifier.watchdog_interval_s
        tick = min(interval, 10.0) if interval else 10.0
        last_ping = 0.0
        while True:
            if self.state is State.STARTING:
                self.notifier.extend_timeout(3 * tick)
            now = time.monotonic()
            if interval and now - last_ping >= interval and not self.state.terminal:
                self.notifier.watchdog()
                last_ping = now
            await asyncio.sleep(tick)

    # --- helpers ------------------------------------------------------------------

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _count_restart(self, reason: str) -> None:
        self.restarts[reason] += 1
        self.metrics.restarts.labels(reason).inc()

    def _count_outcome(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.metrics.requests.labels(outcome).inc()

    def _on_transition(self, old: State, new: State, reason: str) -> None:
        log.info("state transition", from_state=old.value, to_state=new.value, reason=reason)
        self.metrics.set_state(new.value, self.generation_number)
        self.metrics.workers(up=new is State.READY)
        text = f"{new.value} (generation {self.generation_number}): {reason[:200]}"
        if new is State.READY and (not self._announced_ready or self._reloading):
            self._announced_ready, self._reloading = True, False
            self.notifier.ready(text)
        elif new is State.STOPPING:
            self.notifier.stopping(text)
        else:
            self.notifier.status(text)
        self._changed.set()

    @property
    def ready(self) -> bool:
        """Serving, and the last probe passed (what ``/readyz`` and load balancers see)."""
        return self.state is State.READY and self.probe_failures == 0

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "reason": self.machine.reason,
            "generation": self.generation_number,
            "in_flight": self.in_flight,
            "parked": self.parked,
            "admission_queue": self.waiting_new,
            "uptime_s": round(time.monotonic() - self.started_monotonic, 1),
            "model": self.served_model_name,
            "restarts": dict(self.restarts),
            "requests": dict(self.outcomes),
            "recoveries": self.recoveries[-5:],
            "config_error": self.config_error,
            **({"test_held": self.held} if self._test_hooks else {}),
            "probe": {"consecutive_failures": self.probe_failures, "last_duration_s": self.last_probe_s,
                      "last_success_unix": self.last_probe_ok_wall},
        }


def _is_engine_death(exc: BaseException, gen: Generation) -> bool:
    """An error that means the engine (not the request) failed."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(exc, EngineDeadError) or gen.engine.errored
