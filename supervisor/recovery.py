"""The slow work of starting, recovering and stopping engine generations: each method runs as
a task the owner (``supervisor.owner``) starts, and posts what came of it
(``supervisor.events``). Nothing here changes the daemon's or a replica's state: the owner's
dispatch decides what a result means.

A failure's recovery is ``teardown`` (drain the streams' hold on the failed generation, tear
it down: engine core, actors, shared-memory rings), then ``place`` (backoff, the Ray
cluster's return, the replica's placement group), then ``build`` (the next generation, with
what the warm standby prepared), each a task, each a result. Everything that blocks on Ray
or builds an engine runs in a worker thread (``supervisor.builder``).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from health.metrics import SupervisorMetrics
from supervisor import aio, logs
from supervisor.builder import EngineBuilder
from supervisor.clusterloss import ClusterLoss
from supervisor.events import BuildFinished, Drained, Event, Placed, Prepared, StopFinished, TeardownBegan, TeardownFinished
from supervisor.generation import Generation
from supervisor.raylink import RayLink
from supervisor.standby import Standby

if TYPE_CHECKING:
    from supervisor.engine_client import SupervisedEngineClient

log = logs.get_logger("vllm_supervisor.recovery")

Post = Callable[[Event], None]
STOP_SWEEP_WAIT_S = 10.0  # how long the stop waits for killed workers to unmap their rings


class Recovery:
    def __init__(self, builder: EngineBuilder, ray: RayLink, standby: Standby, client: SupervisedEngineClient,
                 cluster: ClusterLoss, post: Post, metrics: SupervisorMetrics):
        """``client`` is the request path: a new engine is attached to it and held as the others are."""
        self.builder, self.ray, self.standby, self.client = builder, ray, standby, client
        self.cluster, self.post, self.metrics = cluster, post, metrics
        self._sweeps: set[asyncio.Future] = set()  # the socket sweeps after a release (held until done)

    async def prepare(self) -> None:
        """The model and the Ray connection, before the first builds."""
        try:
            await asyncio.to_thread(self.builder.prepare_model)
            if self.builder.uses_ray:
                await asyncio.to_thread(self.ray.connect)
                self.metrics.ray_connected.set(1)
        except Exception as exc:
            log.exception("first start failed")
            self.post(Prepared(f"could not start: {type(exc).__name__}: {exc}"))
            return
        self.post(Prepared())

    async def place(self, replica: int, delay_s: float) -> None:
        """Backoff, then the Ray cluster back (when it was lost), then ``replica``'s placement group."""
        phases: dict[str, float] = {}
        try:
            if delay_s:
                await asyncio.sleep(delay_s)
            if self.builder.uses_ray and self.ray.cluster_lost:
                t = time.monotonic()
                ok, detail = await self.cluster.await_back()
                phases["ray_reconnect"] = time.monotonic() - t
                if not ok or detail:  # not back in time, or the daemon is stopping
                    self.post(Placed(replica, detail, fatal=not ok, phases=phases))
                    return
            t = time.monotonic()
            await asyncio.to_thread(self.ray.ensure_placement_group, replica)
            phases["placement_group"] = time.monotonic() - t
        except Exception as exc:
            self.post(Placed(replica, f"{type(exc).__name__}: {exc}", capacity=type(exc).__name__ == "PlacementGroupTimeout",
                             phases=phases))
            return
        self.post(Placed(replica, phases=phases))

    async def build(self, replica: int, number: int, reattach: bool, count_adoption: bool) -> None:
        """Build generation ``number`` of ``replica`` with what the standby has for it; attach
        the request path's front to it when it has none or the engine arguments changed
        (``reattach``). A failed build's leftovers are cleaned up here."""
        builder, standby = self.builder, self.standby
        phases: dict[str, float] = {}
        gen: Generation | None = None
        try:
            if reattach:  # made for the engine arguments a reload just replaced
                await standby.discard("engine arguments changed")
            claim = await standby.claim(number)
            t = time.monotonic()
            gen = await asyncio.to_thread(builder.build, number, claim, replica, standby.starter(number, replica))
            phases["engine_start"] = time.monotonic() - t
            if standby.enabled:
                gen.standby = standby.adopted(number, await self._workers_of(gen), count=count_adoption)
            if self.client.model_config is None or reattach:  # first engine, or a reload changed it
                front = await asyncio.to_thread(builder.front, gen.engine)
                self.client.attach(gen.engine, await gen.engine.get_supported_tasks(), front, gen.epoch)
            await self.hold(gen)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if number in builder.cut_short:  # the stop cut it short (``abandon_builds``)
                log.info("engine build abandoned: the daemon is stopping", failed_generation=number, replica=replica,
                         error=error[:200])
            else:
                log.error("engine build failed", failed_generation=number, replica=replica, error=error[:500])
            try:
                standby.build_failed(number)
                if gen is not None:  # built, then a step after it failed: its engine goes too
                    await self._teardown(gen)
                await asyncio.to_thread(builder.cleanup_failed_build, number)
            except Exception:
                log.exception("cleaning up a failed build raised", failed_generation=number)
            self.post(BuildFinished(replica, number, error=error, phases=phases))
            return
        self.post(BuildFinished(replica, number, gen, phases=phases))

    async def hold(self, gen: Generation) -> None:
        """Give ``gen``'s engine what the others were given (asleep, paused: ``gen.held_as``)."""
        held, gen.held_as = await self.client.hold_like_the_others(gen.engine, gen.held_as)
        if held:
            log.info("new engine held as the others are", engine_generation=gen.number, replica=gen.replica, held=held)

    async def rehold(self, replica: int, gen: Generation) -> None:
        """The operator changed the holds after ``gen`` was held: hold it again, then report
        it built again (the owner serves it once nothing changed meanwhile)."""
        try:
            await self.hold(gen)
        except Exception as exc:
            log.error("holding the new engine failed", engine_generation=gen.number, error=str(exc)[:300])
            await self._teardown(gen)
            self.post(BuildFinished(replica, gen.number, error=f"{type(exc).__name__}: {exc}"))
            return
        self.post(BuildFinished(replica, gen.number, gen))

    async def teardown(self, replica: int, gen: Generation, kill_workers: bool = False, drain: bool = True) -> None:
        """Tear ``gen`` down: the stuck workers first (a hang), then wait (bounded) for its
        streams to let go (``drain``), then the engine, its actors and its rings."""
        phases: dict[str, float] = {}
        error = ""
        try:
            t = time.monotonic()
            if kill_workers:  # a hang: the stuck workers go first (SIGKILL works on stopped ones)
                await asyncio.to_thread(self.builder.kill_stuck_workers, gen)
            if drain:
                await self._drain_readers(gen)
            phases["drain"] = time.monotonic() - t
            t = time.monotonic()
            self.post(TeardownBegan(replica, gen.number, t))
            await self._teardown(gen)
            phases["teardown"] = time.monotonic() - t
        except Exception as exc:
            log.exception("teardown failed", engine_generation=gen.number)
            error = f"recovery failed: {type(exc).__name__}: {exc}"
        self.post(TeardownFinished(replica, gen.number, error, phases))

    async def drain(self, purpose: str, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until no request is in flight."""
        if self.client.in_flight:
            log.info("draining", in_flight=self.client.in_flight, timeout_s=timeout_s, purpose=purpose)
            try:
                await aio.wait_for(self.client.idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("drain deadline passed", in_flight=self.client.in_flight, purpose=purpose)
        self.post(Drained(purpose))

    async def abandon_builds(self) -> None:
        """The stop waits for no build under way (``EngineBuilder.abandon_builds``)."""
        try:  # a thread of its own: the shared pool's may all be held by the builds it cuts short
            killed = await aio.in_own_thread(self.builder.abandon_builds, name="abandon-builds")
        except Exception:
            log.exception("could not abandon the build under way")
            return
        if killed:
            log.warning("stopping: the engine build under way was abandoned", engine_cores_killed=killed)

    async def finish_stop(self) -> None:
        """The last of a stop: the standby, then the Ray cluster."""
        try:
            try:  # bounded (the fork server is killed, not waited for); never skips the release below
                await aio.wait_for(self.standby.stop(), 30)
            except Exception:
                log.exception("could not stop the standby")
            await asyncio.to_thread(self.ray.release)
            # the last workers went with the release: their rings, once they have exited
            await asyncio.to_thread(self.builder.sweep_deferred, STOP_SWEEP_WAIT_S)
        except Exception:
            log.exception("error while stopping")
        finally:
            self.post(StopFinished())

    # --- helpers ------------------------------------------------------------------

    async def _teardown(self, gen: Generation) -> None:
        await asyncio.to_thread(self.builder.teardown, gen)
        await gen.reap_lingering()
        self._release_soon(gen)

    async def _workers_of(self, gen: Generation) -> list[dict[str, Any]]:
        try:
            return await aio.wait_for(asyncio.to_thread(self.ray.workers, gen.instance_id), 10)
        except Exception as exc:
            log.warning("could not list the new generation's workers", error=str(exc))
            return []

    @staticmethod
    async def _drain_readers(gen: Generation, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until every request stream of ``gen`` has let go of it, or is
        inside an abort the engine may never answer (``Generation.lingering``: the teardown's
        reap ends those)."""
        deadline = time.monotonic() + timeout_s
        while any(r not in gen.lingering for r in gen.readers) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _release_soon(self, gen: Generation, delay_s: float = 2.0) -> None:
        """Collect a torn-down generation off the recovery's critical path: the full collection
        holds the GIL for a few hundred ms, and ``delay_s`` after the next build started, that
        build is waiting for its engine-core process to import vLLM, not for this process.
        Its ZeroMQ socket files are swept then, in a thread: the collection closed this
        process's, and its killed workers have exited by then or soon after."""

        def release() -> None:
            log.info("old engine released", engine_generation=gen.number, gc_s=round(gen.release(), 3),
                     lingering=len(gen.lingering))
            sweep = asyncio.ensure_future(asyncio.to_thread(self.builder.sweep_sockets))
            self._sweeps.add(sweep)
            sweep.add_done_callback(self._swept)

        asyncio.get_running_loop().call_later(delay_s, release)

    def _swept(self, sweep: asyncio.Future) -> None:
        self._sweeps.discard(sweep)
        if not sweep.cancelled() and (exc := sweep.exception()) is not None:
            log.warning("could not sweep an old engine's socket files", error=f"{type(exc).__name__}: {exc}")
