"""Starting, recovering and stopping engine generations (a part of the owner,
``supervisor.daemon.Supervisor``, whose task runs every method here).

Each replica (``supervisor.replica``) recovers on its own. A failure marks the replica's
generation failed and parks its streams (they continue at once on another serving replica,
if there is one), then its recovery drains the streams' hold on it, tears it down (engine
core, actors, shared-memory rings) and builds the replica's next generation on the same
placement group, under the daemon's restart intensity limit and with backoff between
failed builds. The daemon is READY while a replica serves; RECOVERING when none does.

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
from health.clusterwatch import SEEN_LATE_S, listening, split_address
from supervisor.events import ClusterLost, EngineFailed, RecoveryFinished, StopFinished
from supervisor.generation import Generation
from supervisor.policy import RestartIntensity, backoff_s
from supervisor.replica import Replica, building, replica_of
from supervisor.states import State

log = logs.get_logger("vllm_supervisor.recovery")

EXIT_OK = 0
EXIT_FAILED = 3  # documented: restart budget exhausted, or the first engine could not start
EXIT_RAY_LOST = 75  # EX_TEMPFAIL: the Ray cluster was lost and did not come back in time


class Lifecycle:
    def __init__(self, replicas: int = 1) -> None:
        self.replicas = [Replica(i, intensity=RestartIntensity(self.cfg.max_restarts, self.cfg.restart_window_s))
                         for i in range(replicas)]
        self._doomed: set[int] = set()  # generations that failed while being built
        self.next_generation = 1
        self.recoveries: list[dict[str, Any]] = []
        self._operation: asyncio.Task | None = None  # the start, or a planned rebuild (operations)
        self._reconnecting = asyncio.Lock()  # one replica reconnects a lost cluster; the others wait
        self._reattach = False  # a reload changed engine arguments: the front takes the new config
        self.cluster_lost_monotonic: float | None = None  # when the GCS stopped answering (while lost)

    # --- failures -----------------------------------------------------------------

    def _on_engine_failed(self, event: EngineFailed) -> None:
        if (rep := building(self.replicas, event.generation)) is not None:
            log.error("engine failed while starting", failed_generation=event.generation, replica=rep.index,
                      cause=event.reason, detail=event.detail)
            self._doomed.add(event.generation)
            return
        if self._refine_cause(event):
            return
        rep = replica_of(self.replicas, event.generation)
        if rep is None or rep.current.failed:
            log.info("ignoring failure of a retired generation", failed_generation=event.generation, cause=event.reason)
            return
        if self.state is State.STOPPING:
            return
        gen = rep.current
        gen.failed = True
        if event.reason == "worker_death":
            self._worker_death_seen(event, rep)
        log.error("engine failed", cause=event.reason, detail=event.detail[:500], replica=rep.index,
                  detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1))
        self._replica_down(rep, f"{event.reason}: {event.detail[:200]}")
        gen.interrupt_streams()  # park every in-flight request (another serving replica takes it at once)
        self._begin_record(rep, gen, event)
        rep.recovery = self._spawn(self._recover(rep, gen, event))

    def _replica_down(self, rep: Replica, reason: str) -> None:
        """``rep`` stopped serving: RECOVERING when no replica serves any more, else READY
        (or DRAINING) goes on with the others."""
        self.metrics.replica(rep.index, up=False, generation=0)
        if any(r.serving() for r in self.replicas):
            log.warning("replica recovering; the others serve", replica=rep.index, reason=reason[:200],
                        serving=[r.index for r in self.replicas if r.serving()])
            self.notifier.status(f"{self.state.value}: replica {rep.index} recovering: {reason[:150]}")
            self.changed.set()
        elif self.state in (State.READY, State.DRAINING, State.RECOVERING):
            self.machine.transition(State.RECOVERING, reason if len(self.replicas) == 1 else f"replica {rep.index}: {reason}")

    def _replica_up(self, rep: Replica, reason: str) -> None:
        self.metrics.replica(rep.index, up=True, generation=rep.current.number)
        if self.state in (State.STARTING, State.RECOVERING):
            self.machine.transition(State.READY, reason if len(self.replicas) == 1 else f"replica {rep.index}: {reason}")
        else:
            log.info("replica serving", replica=rep.index, reason=reason)
            self.changed.set()

    def _begin_record(self, rep: Replica, old: Generation, event: EngineFailed) -> dict[str, Any]:
        """The record of the recovery from ``old``; open (``_refine_cause`` may still sharpen
        its cause) until the recovery ends."""
        rep.record = {"reason": event.reason, "detail": event.detail[:300], "from_generation": old.number,
                      "replica": rep.index, "detected_monotonic": event.detected_monotonic, "phases_s": {},
                      # from the whole of Ray's death cause (the detail is cut short)
                      "cause": death_cause(event.detail) if event.reason == "worker_death" else None}
        return rep.record

    def _refine_cause(self, event: EngineFailed) -> bool:
        """A worker-death report that lost the race to an ``EngineDeadError`` of a request
        (the engine core fails as its worker dies) names the same failure more precisely:
        the recovery under way takes its reason, ranks and cause. Only reports detected
        before that recovery's teardown began (which kills the workers itself) count."""
        rep = next((r for r in self.replicas if r.record and r.record["from_generation"] == event.generation), None)
        rec = rep.record if rep is not None else None
        if (event.reason != "worker_death" or rec is None
                or rec["reason"] != "engine_dead" or event.detected_monotonic >= rec.get("teardown_monotonic", float("inf"))):
            return False
        rec.update(reason="worker_death", detail=event.detail[:300], refined_from="engine_dead",
                   cause=death_cause(event.detail))
        self._worker_death_seen(event, rep)
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
        being_built = [r.building for r in self.replicas if r.building is not None]  # their engine cores lost it too
        timeout = self.settings.ray.reconnect_timeout_s
        log.error("ray cluster lost", address=event.address, detail=event.detail, reconnect_timeout_s=timeout,
                  detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1))
        self.cluster_lost_monotonic = event.detected_monotonic
        self.metrics.ray_connected.set(0)
        await asyncio.to_thread(self.builder.lose_cluster)
        await self.standby.cluster_lost()
        self._doomed.update(being_built)
        reason = f"ray cluster lost ({event.address}: {event.detail}); waiting up to {timeout:g} s for it"
        self._refine_to_cluster_lost(event, reason)
        serving = [r.current for r in self.replicas if r.serving()]
        for gen in serving:
            if self.state is not State.STOPPING:
                self._on_engine_failed(EngineFailed(gen.number, "ray_lost", reason, event.detected_monotonic))
        if not serving and self.state is State.RECOVERING:
            self.machine.transition(State.RECOVERING, reason)

    def _refine_to_cluster_lost(self, event: ClusterLost, reason: str) -> None:
        """A recovery under way from a worker's or the engine core's death that was seen once
        the GCS may already have stopped answering: the head's processes died together (the
        executor reports its workers gone at once; the loss counts only after
        ``gcs_lost_after_s``). Its cause is the cluster's loss."""
        for rep in self.replicas:
            rec = rep.record
            if (rec and rec["reason"] in ("worker_death", "engine_dead")
                    and rec["detected_monotonic"] >= event.detected_monotonic - SEEN_LATE_S):
                log.info("failure cause refined", cause="ray_lost", replica=rep.index, refined_from=rec["reason"])
                rec.update(reason="ray_lost", detail=reason[:300], refined_from=rec["reason"], cause=None)

    async def _await_cluster(self) -> tuple[bool, str]:
        """Until the deadline: wait for the lost GCS to listen again (a private cluster is
        started anew at once), then connect a new agent (one replica does; the others wait
        for it). Returns (ok, detail)."""
        async with self._reconnecting:
            if not self.builder.cluster_lost:
                return True, ""
            return await self._reconnect()

    async def _reconnect(self) -> tuple[bool, str]:
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
        """The model and the Ray connection, then every replica's first engine (their builds
        take turns, ``EngineBuilder.build``); READY when the first is up."""
        try:
            await asyncio.to_thread(self.builder.prepare_model)
            if self.builder.uses_ray:
                await asyncio.to_thread(self.builder.connect_ray)
                self.metrics.ray_connected.set(1)
        except Exception as exc:
            log.exception("first start failed")
            self.post(RecoveryFinished(False, f"could not start: {type(exc).__name__}: {exc}"))
            return
        for rep in self.replicas:
            rep.recovery = self._spawn(self._first_up(rep))

    async def _first_up(self, rep: Replica) -> None:
        ok, detail = await self._bring_up(rep, first=True)
        self.post(RecoveryFinished(ok, detail))

    async def _recover(self, rep: Replica, old: Generation, event: EngineFailed) -> None:
        started = time.monotonic()
        record = rep.record
        if record is None or record["from_generation"] != old.number:
            record = self._begin_record(rep, old, event)
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
            if rep.current is old:
                rep.current = None
            phases["teardown"] = time.monotonic() - t
            self._release_soon(old)
            ok, detail = await self._bring_up(rep, first=False, phases=phases)
        except Exception as exc:
            log.exception("recovery failed")
            ok, detail = False, f"recovery failed: {type(exc).__name__}: {exc}"
        finally:  # also when cancelled: the record is closed and the restart counted
            rep.record = None
            self._count_restart(record["reason"], rep)
        record.update(ok=ok, total_s=time.monotonic() - started, to_generation=rep.current.number if rep.current else 0,
                      ready_monotonic=time.monotonic())
        self.recoveries.append(record)
        if ok:
            self.metrics.recovery(rep.index, record["total_s"] + phases["detect"], phases)
        log.info("recovery finished", ok=ok, **{f"{k}_s": round(v, 3) for k, v in phases.items()},
                 total_s=round(record["total_s"], 3))
        self.post(RecoveryFinished(ok, detail))

    async def _bring_up(self, rep: Replica, first: bool, phases: dict[str, float] | None = None) -> tuple[bool, str]:
        """Place ``rep``'s workers and build engines until one is up, the restart budget is
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
            if (not first or attempt > 0) and not rep.intensity.record():
                spent = f"restart intensity exceeded: more than {self.cfg.max_restarts} restarts in {self.cfg.restart_window_s:g} s"
                if len(self.replicas) == 1:
                    return False, spent
                if not await self._wait_for_budget(rep, spent):
                    return False, f"replica {rep.index}: {spent}, and no other replica serves"
                continue  # stopping, or the budget has room again
            delay = backoff_s(attempt, self.cfg.restart_backoff_initial_s, self.cfg.restart_backoff_max_s)
            if delay:
                await asyncio.sleep(delay)
            attempt += 1
            number = None
            try:
                t = time.monotonic()
                await asyncio.to_thread(self.builder.ensure_placement_group, rep.index)
                phases["placement_group"] = time.monotonic() - t
                if self._reattach:  # made for the engine arguments a reload just replaced
                    await self.standby.discard("engine arguments changed")
                # The first build placed takes the standby's (reserved) number, whichever replica
                # it is for; no await between taking a number and claiming the standby.
                number = self.standby.reserved()
                if number is None:
                    number, self.next_generation = self.next_generation, self.next_generation + 1
                rep.building = number
                claim = await self.standby.claim(number)
                t = time.monotonic()
                gen = await asyncio.to_thread(self.builder.build, number, claim, rep.index)
                phases["engine_start"] = time.monotonic() - t
                if self.standby.enabled:  # while building still names it: a failure now dooms it
                    gen.standby = self.standby.adopted(number, await self._workers_of(gen), count=not (first and attempt == 1))
                    if rep.record is not None:
                        rep.record["standby"] = gen.standby
                if self.client.model_config is None or self._reattach:  # first engine, or a reload changed it
                    front = await asyncio.to_thread(self.builder.front, gen.engine)
                    self.client.attach(gen.engine, await gen.engine.get_supported_tasks(), front, gen.epoch)
                    self._reattach = False
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                rep.building, rep.last_error = None, error[:300]
                self._count_restart("build_failed", rep)
                log.error("engine build failed", failed_generation=number, replica=rep.index, error=error[:500])
                if type(exc).__name__ == "PlacementGroupTimeout" and self.state is State.RECOVERING:
                    self.machine.transition(State.RECOVERING, f"waiting for capacity: {exc}")
                if number is not None:  # not placed: no number taken, nothing built
                    self.standby.build_failed(number)
                    await asyncio.to_thread(self.builder.cleanup_failed_build, number)
                continue
            rep.building = None
            if number in self._doomed or self.state is State.STOPPING:
                self._doomed.discard(number)
                await self._discard(gen)
                if self.state is State.STOPPING:
                    return True, "stopping"
                self._count_restart("build_failed", rep)
                continue
            gen.replica = rep.index
            rep.current, rep.served, rep.last_error = gen, True, ""
            verb = "up" if first and attempt == 1 else "recovered"
            self._replica_up(rep, f"engine generation {number} {verb} in {gen.build_s:.1f} s")
            if self.standby.prepare(self.next_generation, gen.engine.vllm_config, rep.index):
                self.next_generation += 1  # reserved for the standby: the next build placed takes it
            return True, ""

    async def _wait_for_budget(self, rep: Replica, spent: str) -> bool:
        """``rep``'s restart budget is spent: while another replica serves or is on its way up
        (starting or recovering, its budget not spent), ``rep`` waits until its budget allows
        one more restart ("waiting" in its status, the ``replica_restart_budget_spent``
        metric). True: try again (or stopping); False: no other replica serves or can, the
        daemon fails."""
        others = [r for r in self.replicas if r is not rep]
        rep.retry_at = time.monotonic() + rep.intensity.free_in()
        self.metrics.replica_budget_spent.labels(str(rep.index)).set(1)
        log.error("replica's restart budget spent; the others serve, it waits to retry", replica=rep.index,
                  reason=spent, retry_in_s=round(rep.retry_at - time.monotonic(), 1), last_error=rep.last_error,
                  serving=[r.index for r in others if r.serving()])
        self.notifier.status(f"{self.state.value}: replica {rep.index} waiting: {spent}")
        self.changed.set()
        try:
            while (left := rep.retry_at - time.monotonic()) > 0:
                if self.state is State.STOPPING:
                    return True
                if not any(r.serving() or (r.busy and r.retry_at is None) for r in others):
                    return False
                await asyncio.sleep(min(1.0, left))
            log.info("replica's restart budget has room again; retrying", replica=rep.index)
            return True
        finally:
            rep.retry_at = None
            self.metrics.replica_budget_spent.labels(str(rep.index)).set(0)
            self.changed.set()

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
            if self.client.in_flight and self.exit_code == EXIT_OK and any(r.current for r in self.replicas):
                timeout = self.cfg.drain_timeout_s
                log.info("draining", in_flight=self.client.in_flight, timeout_s=timeout)
                try:
                    await aio.wait_for(self.client.idle.wait(), timeout)
                except asyncio.TimeoutError:
                    log.warning("drain deadline passed", in_flight=self.client.in_flight)
            # let engine builds in progress finish, then drop them
            running = {t for t in [self._operation, *(r.recovery for r in self.replicas)] if t is not None and not t.done()}
            if running:
                await asyncio.wait(running, timeout=self.cfg.recovery_timeout_s)
            for rep in self.replicas:
                gen, rep.current = rep.current, None
                self.metrics.replica(rep.index, up=False, generation=0)
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
