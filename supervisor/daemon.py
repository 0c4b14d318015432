"""The supervisor: one owner task, one state machine, every failure source as one event.

Invariants:
* only the owner task (``Supervisor.run``) changes ``self.machine`` and ``self.current``;
* signal handlers and the executor's death events only enqueue;
* everything that blocks on Ray or builds an engine runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from config import Settings
from executor.events import WorkerDeathEvent
from supervisor import logs
from supervisor.states import State, StateMachine

log = logs.get_logger("vllm_supervisor.daemon")

EXIT_OK = 0
EXIT_FAILED = 3  # documented: restart budget exhausted / engine could not start


# --- events for the owner task ---------------------------------------------------------


@dataclass(frozen=True)
class SignalReceived:
    signum: int


@dataclass(frozen=True)
class EngineBuilt:
    generation: "Generation"


@dataclass(frozen=True)
class EngineBuildFailed:
    number: int
    error: str


@dataclass(frozen=True)
class WorkerDied:
    event: WorkerDeathEvent


@dataclass(frozen=True)
class StopFinished:
    pass


Event = SignalReceived | EngineBuilt | EngineBuildFailed | WorkerDied | StopFinished


@dataclass
class Generation:
    """One engine and what it owns."""

    number: int
    instance_id: str
    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    shm_before: set[str]
    build_s: float
    core_pids: list[int] = field(default_factory=list)


class EngineUnavailable(Exception):
    """No engine can take the request now (the HTTP layer answers 503 + Retry-After)."""

    def __init__(self, reason: str, retry_after_s: int = 5):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class Supervisor:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.machine = StateMachine()
        self.machine.on_transition.append(self._log_transition)
        self.daemon_id = f"vsup{os.getpid()}x{uuid.uuid4().hex[:6]}"
        self.current: Generation | None = None
        self.next_generation = 1
        self.started_monotonic = time.monotonic()
        self.exit_code = EXIT_OK
        self.model_path = ""
        self.served_model_name = ""
        self.tokenizer: Any = None
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ready = asyncio.Event()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cluster: Any = None
        self._placement_group: Any = None
        self._tasks: set[asyncio.Task] = set()
        self.runtime_dir = Path(
            os.environ.get("RUNTIME_DIRECTORY") or tempfile.mkdtemp(prefix="vllm-supervisor-")
        )
        self._own_runtime_dir = "RUNTIME_DIRECTORY" not in os.environ
        self.event_endpoint = f"ipc://{self.runtime_dir}/events-{os.getpid()}.sock"
        logs.set_context_provider(
            lambda: {"state": self.machine.state.value, "generation": self.generation_number}
        )

    # --- read-only views (any task) -------------------------------------------------

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def generation_number(self) -> int:
        return self.current.number if self.current else 0

    @property
    def placement_group_prefix(self) -> str:
        return f"{self.daemon_id}-pg"

    # --- requests (called from HTTP handlers) ----------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: Any, request_id: str
    ) -> AsyncIterator[Any]:
        """Stream ``RequestOutput`` deltas for one request from the current engine."""
        if self.state is not State.READY or self.current is None:
            raise EngineUnavailable(f"daemon is {self.state.value}: {self.machine.reason}")
        engine = self.current.engine
        self.in_flight += 1
        self._idle.clear()
        try:
            async for output in engine.generate(
                {"prompt_token_ids": prompt_token_ids}, params, request_id
            ):
                yield output
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    # --- the owner task ---------------------------------------------------------------

    def post(self, event: Event) -> None:
        """Thread-unsafe enqueue; from other threads use ``loop.call_soon_threadsafe``."""
        self._events.put_nowait(event)

    def _install_signal_handlers(self) -> None:
        """Signals only enqueue. Re-run after ``ray.init``: Ray's core worker installs
        absl's failure handler over SIGTERM, which aborts the process."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
            loop.add_signal_handler(signum, self.post, SignalReceived(signum))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._install_signal_handlers()
        listener = self._spawn(self._listen_for_worker_deaths())
        try:
            self._spawn(self._start_first_engine())
            while not self.state.terminal:
                event = await self._events.get()
                try:
                    await self._handle(event)
                except Exception as exc:  # one bad event must not stop the loop
                    log.exception("event handler failed", event=type(event).__name__, error=str(exc))
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            listener.cancel()
            if self._own_runtime_dir:
                shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return self.exit_code

    async def _handle(self, event: Event) -> None:
        if isinstance(event, SignalReceived):
            await self._on_stop_signal(event.signum)
        elif isinstance(event, EngineBuilt):
            await self._on_engine_built(event.generation)
        elif isinstance(event, EngineBuildFailed):
            self.exit_code = EXIT_FAILED
            log.error("engine could not start", error=event.error, engine_generation=event.number)
            self._begin_stop(State.FAILED, f"engine generation {event.number} failed to start")
        elif isinstance(event, WorkerDied):
            await self._on_worker_died(event.event)
        elif isinstance(event, StopFinished):
            self.machine.transition(
                State.STOPPED if self.exit_code == EXIT_OK else State.FAILED,
                "stopped" if self.exit_code == EXIT_OK else self.machine.reason,
            )

    async def _on_stop_signal(self, signum: int) -> None:
        if self.state in (State.STOPPING, State.FAILED):
            log.info("stop already in progress", signal=signal.Signals(signum).name)
            return
        self._begin_stop(State.STOPPING, f"{signal.Signals(signum).name} received")

    async def _on_engine_built(self, gen: Generation) -> None:
        if self.state is State.STOPPING:
            await asyncio.to_thread(self._teardown_generation, gen)
            return
        self.current = gen
        if self.tokenizer is None:
            self.tokenizer = gen.engine.get_tokenizer()
        self.machine.transition(State.READY, f"engine generation {gen.number} up in {gen.build_s:.1f} s")
        self._ready.set()

    async def _on_worker_died(self, event: WorkerDeathEvent) -> None:
        if self.current is None or event.generation != self.current.number:
            log.info("ignoring death event of an old generation", dead_generation=event.generation)
            return
        log.error(
            "worker died",
            ranks=event.ranks,
            actors=event.actor_names,
            cause=event.cause,
            detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1),
        )
        self.exit_code = EXIT_FAILED
        self._begin_stop(State.FAILED, f"worker rank(s) {event.ranks} died")

    # --- starting -----------------------------------------------------------------

    async def _start_first_engine(self) -> None:
        try:
            await asyncio.to_thread(self._prepare_model)
            self._cluster = await asyncio.to_thread(self._connect_ray)
            self._install_signal_handlers()
            self._placement_group = await asyncio.to_thread(self._create_placement_group)
            gen = await asyncio.to_thread(self._build_generation, self.next_generation)
        except Exception as exc:
            log.exception("first start failed")
            self.post(EngineBuildFailed(self.next_generation, f"{type(exc).__name__}: {exc}"))
            return
        self.post(EngineBuilt(gen))

    def _prepare_model(self) -> None:
        engine = self.settings.engine
        if engine.model:
            self.model_path = engine.model
            self.served_model_name = engine.served_model_name or engine.model
            return
        from supervisor.demo_model import build_demo_model

        started = time.monotonic()
        self.model_path = str(build_demo_model(self.settings.supervisor.data_dir))
        self.served_model_name = engine.served_model_name or "demo-tiny-llama"
        log.warning(
            "no model configured: serving the built-in demo model; its outputs are random noise",
            model_path=self.model_path,
            build_s=round(time.monotonic() - started, 2),
        )

    def _connect_ray(self) -> Any:
        from executor.cluster import RayCluster

        cluster = RayCluster(self.settings.ray)
        address = cluster.connect()
        log.info("ray connected", address=address, local=cluster.started_local)
        return cluster

    def _world_size(self) -> int:
        e = self.settings.engine
        return e.tensor_parallel_size * e.pipeline_parallel_size

    def _create_placement_group(self) -> Any:
        from executor.engine import is_cpu_platform

        device = "CPU" if is_cpu_platform() else "GPU"
        started = time.monotonic()
        pg = self._cluster.create_placement_group(
            f"{self.placement_group_prefix}", self._world_size(), device
        )
        log.info(
            "placement group ready",
            bundles=self._world_size(),
            device=device,
            took_s=round(time.monotonic() - started, 3),
        )
        return pg

    def _dtype(self) -> str:
        """The demo model is float32 (greedy output must not depend on batch layout)."""
        dtype = self.settings.engine.dtype
        if dtype == "auto" and not self.settings.engine.model:
            return "float32"
        return dtype

    def _build_generation(self, number: int) -> Generation:
        from executor.engine import EngineSpec, build_engine, engine_core_pids
        from executor.shm import vllm_segments

        self.next_generation = number + 1
        instance_id = f"{self.daemon_id}-g{number}"
        shm_before = vllm_segments()
        started = time.monotonic()
        log.info("building engine", engine_generation=number, instance_id=instance_id)
        engine = build_engine(
            EngineSpec(
                settings=self.settings.engine,
                model_path=self.model_path,
                served_model_name=self.served_model_name,
                generation=number,
                instance_id=instance_id,
                event_endpoint=self.event_endpoint,
                placement_group=self._placement_group,
                dtype=self._dtype(),
            )
        )
        build_s = time.monotonic() - started
        log.info("engine up", engine_generation=number, build_s=round(build_s, 2))
        return Generation(number, instance_id, engine, shm_before, build_s, engine_core_pids(engine))

    # --- stopping -----------------------------------------------------------------

    def _begin_stop(self, to: State, reason: str) -> None:
        """Stop admitting at once; drain, tear down and report ``StopFinished``."""
        if to is State.FAILED:
            # FAILED is terminal for the machine: clean up first, then enter it.
            self.machine.reason = reason
            if self.state is not State.STOPPING:
                self.machine.transition(State.STOPPING, reason)
        else:
            self.machine.transition(State.STOPPING, reason)
        self._ready.clear()
        self._spawn(self._stop())

    async def _stop(self) -> None:
        try:
            if self.exit_code == EXIT_OK and self.in_flight:
                timeout = self.settings.supervisor.drain_timeout_s
                log.info("draining", in_flight=self.in_flight, timeout_s=timeout)
                try:
                    await asyncio.wait_for(self._idle.wait(), timeout)
                except asyncio.TimeoutError:
                    log.warning("drain deadline passed", in_flight=self.in_flight)
            gen, self.current = self.current, None
            if gen is not None:
                await asyncio.to_thread(self._teardown_generation, gen)
            await asyncio.to_thread(self._release_cluster)
        except Exception:
            log.exception("error while stopping")
        finally:
            self.post(StopFinished())

    def _teardown_generation(self, gen: Generation) -> None:
        from executor.engine import shutdown_engine
        from executor.shm import sweep, vllm_segments

        started = time.monotonic()
        try:
            shutdown_engine(gen.engine)
        except Exception:
            log.exception("engine shutdown raised", engine_generation=gen.number)
        killed = self._cluster.kill_actors_named(gen.instance_id) if self._cluster else []
        # Killed workers may take a moment to exit and unmap their rings.
        removed: list[str] = []
        deadline = time.monotonic() + 10.0
        while True:
            leftover = vllm_segments() - gen.shm_before
            removed += sweep(leftover)
            if not (vllm_segments() - gen.shm_before) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        log.info(
            "engine torn down",
            engine_generation=gen.number,
            leftover_actors_killed=killed,
            shm_removed=removed,
            took_s=round(time.monotonic() - started, 2),
        )

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
                    self.post(WorkerDied(WorkerDeathEvent.from_json(raw)))
                except (ValueError, TypeError) as exc:
                    log.warning("malformed executor event", error=str(exc))
        finally:
            sock.close(linger=0)

    # --- helpers ------------------------------------------------------------------

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _log_transition(self, old: State, new: State, reason: str) -> None:
        log.info("state transition", from_state=old.value, to_state=new.value, reason=reason)

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "reason": self.machine.reason,
            "generation": self.generation_number,
            "in_flight": self.in_flight,
            "uptime_s": round(time.monotonic() - self.started_monotonic, 1),
            "model": self.served_model_name,
        }
