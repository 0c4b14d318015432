"""Starting, recovering and stopping engine generations (a part of the owner,
``supervisor.daemon.Supervisor``, whose task runs every method here).

A failure marks the serving generation failed, parks its streams, and starts a recovery:
drain the streams' hold on it, tear it down (engine core, actors, shared-memory rings),
then build the next generation on the same placement group, under the restart intensity
limit and with backoff between failed builds.

Loss of the Ray cluster (``ClusterLost``) kills the Ray agent at once, fails the serving
generation like any fault, and makes every build wait (up to ``ray.reconnect_timeout_s``)
for the GCS to listen again and a new agent to connect; past that the daemon exits 75.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from health.metrics import death_cause
from supervisor import aio, logs
from health.clusterwatch import listening, split_address
from supervisor.events import ClusterLost, EngineFailed, RecoveryFinished, StopFinished
from supervisor.generation import Generation
from supervisor.policy import backoff_s
from supervisor.states import State

log = logs.get_logger("vllm_supervisor.recovery")

EXIT_OK = 0
EXIT_FAILED = 3  # documented: restart budget exhausted, or the first engine could not start
EXIT_RAY_LOST = 75  # EX_TEMPFAIL: the Ray cluster was lost and did not come back in time


class Lifecycle:
    def __init__(self) -> None:
        self._building: int | None = None  # generation number being built
        self._doomed: set[int] = set()  # generations that failed while being built
        self.next_generation = 1
        self.recoveries: list[dict[str, Any]] = []
        self._recovery: asyncio.Task | None = None
        self._active_record: dict[str, Any] | None = None  # the recovery under way
        self._reattach = False  # a reload changed engine arguments: the front takes the new config
        self.cluster_lost_monotonic: float | None = None  # when the GCS stopped answering (while lost)

    # --- failures -----------------------------------------------------------------

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
            self._worker_death_seen(event)
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
        self._worker_death_seen(event)
        log.info("failure cause refined", cause="worker_death", detail=event.detail[:300])
        return True

    # --- the Ray cluster lost -------------------------------------------------------------

    async def _on_cluster_lost(self, event: ClusterLost) -> None:
        """Kill the Ray agent before a new GCS can answer it, forget the standby's workers
        (they went with the cluster) and fail the serving generation; the recovery waits for
        the cluster in ``_await_cluster``."""
        if (self.builder.cluster_lost or self.builder.cluster is None or self.state.terminal
                or self.builder.released or (event.agent_pid is not None and event.agent_pid != self.builder.agent_pid)):
            return
        building = self._building  # its engine core lost the cluster too (captured before the awaits)
        timeout = self.settings.ray.reconnect_timeout_s
        log.error("ray cluster lost", address=event.address, detail=event.detail, reconnect_timeout_s=timeout,
                  detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1))
        self.cluster_lost_monotonic = event.detected_monotonic
        self.metrics.ray_connected.set(0)
        await asyncio.to_thread(self.builder.lose_cluster)
        await self.standby.cluster_lost()
        if building is not None:
            self._doomed.add(building)
        reason = f"ray cluster lost ({event.address}: {event.detail}); waiting up to {timeout:g} s for it"
        gen = self.current
        if gen is not None and not gen.failed and self.state is not State.STOPPING:
            self._on_engine_failed(EngineFailed(gen.number, "ray_lost", reason, event.detected_monotonic))
        elif self.state is State.RECOVERING:
            self.machine.transition(State.RECOVERING, reason)

    async def _await_cluster(self) -> tuple[bool, str]:
        """Until the deadline: wait for the lost GCS to listen again (a private cluster is
        started anew at once), then connect a new agent. Returns (ok, detail)."""
        timeout = self.settings.ray.reconnect_timeout_s
        lost_at = self.cluster_lost_monotonic or time.monotonic()
        private = self.builder.cluster.started_local
        # The configured host:port when there is one (a head that returns on a new IP behind a
        # name), else the address Ray reported (``auto``).
        configured = self.settings.ray.address
        address = configured if split_address(configured) else self.builder.gcs_address
        while time.monotonic() < lost_at + timeout:
            if self.state is State.STOPPING:
                return True, "stopping"
            if private or await listening(address) is None:
                try:
                    await asyncio.to_thread(self.builder.connect_ray)  # a new agent
                except Exception as exc:  # the GCS listens before its node is up: try again
                    log.warning("ray reconnect failed; retrying", error=f"{type(exc).__name__}: {exc}"[:300])
                    await asyncio.sleep(1.0)
                    continue
                lost_for = time.monotonic() - lost_at
                self.cluster_lost_monotonic = None
                self.metrics.ray_connected.set(1)
                log.info("ray cluster back", address=self.builder.gcs_address, lost_for_s=round(lost_for, 2))
                if self.state is State.RECOVERING:
                    self.machine.transition(State.RECOVERING, f"ray cluster back after {lost_for:.1f} s; rebuilding")
                return True, ""
            await asyncio.sleep(0.5)
        return False, f"ray cluster at {address} lost and not back within {timeout:g} s"

    # --- starting and recovering --------------------------------------------------------

    async def _start(self) -> None:
        try:
            await asyncio.to_thread(self.builder.prepare_model)
            if self.builder.uses_ray:
                await asyncio.to_thread(self.builder.connect_ray)
                self.metrics.ray_connected.set(1)
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
                await asyncio.to_thread(self.builder.kill_stuck_workers, old)
            await self._drain_pumps(old)
            phases["drain"] = time.monotonic() - t
            t = record["teardown_monotonic"] = time.monotonic()
            await asyncio.to_thread(self.builder.teardown, old)
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
            if self.builder.uses_ray and self.builder.cluster_lost:
                t = time.monotonic()
                ok, detail = await self._await_cluster()
                phases["ray_reconnect"] = phases.get("ray_reconnect", 0.0) + time.monotonic() - t
                if not ok or self.state is State.STOPPING:
                    return ok, detail
            if (not first or attempt > 0) and not self.intensity.record():
                return False, (f"restart intensity exceeded: more than {self.cfg.max_restarts} restarts "
                               f"in {self.cfg.restart_window_s:g} s")
            delay = backoff_s(attempt, self.cfg.restart_backoff_initial_s, self.cfg.restart_backoff_max_s)
            if delay:
                await asyncio.sleep(delay)
            attempt += 1
            number = self._building = self.next_generation
            self.next_generation += 1
            try:
                t = time.monotonic()
                await asyncio.to_thread(self.builder.ensure_placement_group)
                phases["placement_group"] = time.monotonic() - t
                if self._reattach:  # made for the engine arguments a reload just replaced
                    await self.standby.discard("engine arguments changed")
                claim = await self.standby.claim(number)
                t = time.monotonic()
                gen = await asyncio.to_thread(self.builder.build, number, claim)
                phases["engine_start"] = time.monotonic() - t
                if self.standby.enabled:  # while _building still names it: a failure now dooms it
                    gen.standby = self.standby.adopted(number, await self._workers_of(gen), count=not (first and attempt == 1))
                    if self._active_record is not None:
                        self._active_record["standby"] = gen.standby
                if self.client.model_config is None or self._reattach:  # first engine, or a reload changed it
                    front = await asyncio.to_thread(self.builder.front, gen.engine)
                    self.client.attach(gen.engine, await gen.engine.get_supported_tasks(), front)
                    self._reattach = False
            except Exception as exc:
                self._building = None
                self.standby.build_failed()
                self._count_restart("build_failed")
                log.error("engine build failed", failed_generation=number, error=f"{type(exc).__name__}: {exc}"[:500])
                if type(exc).__name__ == "PlacementGroupTimeout" and self.state is State.RECOVERING:
                    self.machine.transition(State.RECOVERING, f"waiting for capacity: {exc}")
                await asyncio.to_thread(self.builder.cleanup_failed_build, number)
                continue
            self._building = None
            if number in self._doomed or self.state is State.STOPPING:
                self._doomed.discard(number)
                await self._discard(gen)
                if self.state is State.STOPPING:
                    return True, "stopping"
                self._count_restart("build_failed")
                continue
            self.current = gen
            verb = "up" if first and attempt == 1 else "recovered"
            self.machine.transition(State.READY, f"engine generation {number} {verb} in {gen.build_s:.1f} s")
            self.standby.prepare(self.next_generation, gen.engine.vllm_config)
            return True, ""

    async def _workers_of(self, gen: Generation) -> list[dict[str, Any]]:
        try:
            return await aio.wait_for(asyncio.to_thread(self.builder.workers, gen.instance_id), 10)
        except Exception as exc:
            log.warning("could not list the new generation's workers", error=str(exc))
            return []

    async def _discard(self, gen: Generation) -> None:
        await asyncio.to_thread(self.builder.teardown, gen)
        await gen.reap_lingering()
        self._release_soon(gen)

    async def _drain_pumps(self, gen: Generation, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until every request stream of ``gen`` has let go of it."""
        deadline = time.monotonic() + timeout_s
        while gen.pumps and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _release_soon(self, gen: Generation, delay_s: float = 2.0) -> None:
        """Collect a torn-down generation off the recovery's critical path: the full collection
        holds the GIL for a few hundred ms, and ``delay_s`` after the next build started, that
        build is waiting for its engine-core process to import vLLM, not for this process."""

        def release() -> None:
            log.info("old engine released", engine_generation=gen.number, gc_s=round(gen.release(), 3),
                     lingering=len(gen.lingering))

        asyncio.get_running_loop().call_later(delay_s, release)

    # --- stopping -----------------------------------------------------------------

    def _begin_stop(self, reason: str) -> None:
        """Stop admitting at once; drain, tear down and report ``StopFinished``."""
        self.machine.transition(State.STOPPING, reason)
        self._spawn(self._stop())

    async def _stop(self) -> None:
        try:
            if self.client.in_flight and self.exit_code == EXIT_OK and self.current is not None:
                timeout = self.cfg.drain_timeout_s
                log.info("draining", in_flight=self.client.in_flight, timeout_s=timeout)
                try:
                    await aio.wait_for(self.client.idle.wait(), timeout)
                except asyncio.TimeoutError:
                    log.warning("drain deadline passed", in_flight=self.client.in_flight)
            if self._recovery is not None:  # let an engine build in progress finish, then drop it
                await asyncio.wait({self._recovery}, timeout=self.cfg.recovery_timeout_s)
            gen, self.current = self.current, None
            if gen is not None:
                gen.interrupt_streams()
                await asyncio.to_thread(self.builder.teardown, gen)
                await gen.reap_lingering()
            try:  # bounded (the fork server is killed, not waited for); never skips the release below
                await aio.wait_for(self.standby.stop(), 30)
            except Exception:
                log.exception("could not stop the standby")
            await asyncio.to_thread(self.builder.release_cluster)
        except Exception:
            log.exception("error while stopping")
        finally:
            self.post(StopFinished())
