"""Starting, recovering and stopping engine generations (a part the owner,
``supervisor.daemon.Supervisor``, builds; its task runs every method here).

Each replica (``supervisor.replica``) recovers on its own. A failure marks the replica's
generation failed and parks its streams (they continue at once on another serving replica,
if there is one), then its recovery drains the streams' hold on it, tears it down (engine
core, actors, shared-memory rings) and builds the replica's next generation on the same
placement group, under the replica's restart budget and with backoff between failed builds.
Each recovery keeps a record (``supervisor.record``) that names its cause at close. The
daemon is READY while a replica serves; RECOVERING when none does. A lost Ray cluster is
``supervisor.clusterloss``: the builds wait there for it to come back.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from supervisor import aio, logs
from supervisor.events import EngineFailed, RecoveryFinished, StopFinished
from supervisor.generation import Generation
from supervisor.owner import Owner
from supervisor.policy import RestartIntensity, backoff_s
from supervisor.record import RecoveryRecord
from supervisor.replica import Replica, building, replica_of
from supervisor.states import State

log = logs.get_logger("vllm_supervisor.recovery")

EXIT_OK = 0
EXIT_FAILED = 3  # documented: restart budget exhausted, or the first engine could not start
EXIT_RAY_LOST = 75  # EX_TEMPFAIL: the Ray cluster was lost and did not come back in time


class Recovery:
    def __init__(self, sup: Owner) -> None:
        self.sup = sup
        cfg = sup.cfg
        self.replicas = [Replica(i, intensity=RestartIntensity(cfg.max_restarts, cfg.restart_window_s))
                         for i in range(cfg.replicas)]
        self.next_generation = 1
        self.records: list[dict[str, Any]] = []  # closed recovery records (``status()["recoveries"]``)
        self.reattach = False  # a reload changed engine arguments: the front takes the new config
        self._doomed: set[int] = set()  # generations that failed while being built

    def doom(self, numbers: Any) -> None:
        """The generations ``numbers``, being built, failed: their builds are thrown away."""
        self._doomed.update(numbers)

    # --- failures -----------------------------------------------------------------

    def on_engine_failed(self, event: EngineFailed) -> None:
        sup = self.sup
        if (rep := building(self.replicas, event.generation)) is not None:
            log.error("engine failed while starting", failed_generation=event.generation, replica=rep.index,
                      cause=event.reason, detail=event.detail)
            self._doomed.add(event.generation)
            return
        if self._adds_evidence(event):
            return
        rep = replica_of(self.replicas, event.generation)
        if rep is None or rep.current.failed:
            log.info("ignoring failure of a retired generation", failed_generation=event.generation, cause=event.reason)
            return
        if sup.state is State.STOPPING:
            return
        gen = rep.current
        gen.failed = True
        if event.reason == "worker_death":
            sup.worker_death_seen(event, rep)
        log.error("engine failed", cause=event.reason, detail=event.detail[:500], replica=rep.index,
                  detect_ms=round((time.monotonic() - event.detected_monotonic) * 1000, 1))
        self.replica_down(rep, f"{event.reason}: {event.detail[:200]}")
        gen.interrupt_streams()  # park every in-flight request (another serving replica takes it at once)
        rep.record = RecoveryRecord(rep.index, gen.number, event)
        rep.recovery = sup.spawn(self.recover(rep, gen, event))

    def _adds_evidence(self, event: EngineFailed) -> bool:
        """A worker-death report about a generation whose recovery is under way (it lost the
        race to the engine core's death): evidence for that recovery's record."""
        rep = next((r for r in self.replicas if r.record and r.record.from_generation == event.generation), None)
        if rep is None or not rep.record.add_worker_death(event):
            return False
        self.sup.worker_death_seen(event, rep)
        log.info("failure cause refined", cause="worker_death", detail=event.detail[:300])
        return True

    def replica_down(self, rep: Replica, reason: str) -> None:
        """``rep`` stopped serving: RECOVERING when no replica serves any more, else READY
        (or DRAINING) goes on with the others."""
        sup = self.sup
        sup.metrics.replica(rep.index, up=False, generation=0)
        if any(r.serving() for r in self.replicas):
            log.warning("replica recovering; the others serve", replica=rep.index, reason=reason[:200],
                        serving=[r.index for r in self.replicas if r.serving()])
            sup.notifier.status(f"{sup.state.value}: replica {rep.index} recovering: {reason[:150]}")
            sup.changed.set()
        elif sup.state in (State.READY, State.DRAINING, State.RECOVERING):
            sup.machine.transition(State.RECOVERING, reason if len(self.replicas) == 1 else f"replica {rep.index}: {reason}")

    def _replica_up(self, rep: Replica, reason: str) -> None:
        sup = self.sup
        sup.metrics.replica(rep.index, up=True, generation=rep.current.number)
        if sup.state in (State.STARTING, State.RECOVERING):
            sup.machine.transition(State.READY, reason if len(self.replicas) == 1 else f"replica {rep.index}: {reason}")
        else:
            log.info("replica serving", replica=rep.index, reason=reason)
            sup.changed.set()

    # --- starting and recovering --------------------------------------------------------

    async def start(self) -> None:
        """The model and the Ray connection, then every replica's first engine (their builds
        take turns, ``EngineBuilder.build``); READY when the first is up."""
        sup = self.sup
        try:
            await asyncio.to_thread(sup.builder.prepare_model)
            if sup.builder.uses_ray:
                await asyncio.to_thread(sup.ray.connect)
                sup.metrics.ray_connected.set(1)
        except Exception as exc:
            log.exception("first start failed")
            sup.post(RecoveryFinished(False, f"could not start: {type(exc).__name__}: {exc}"))
            return
        for rep in self.replicas:
            rep.recovery = sup.spawn(self._first_up(rep))

    async def _first_up(self, rep: Replica) -> None:
        ok, detail = await self._bring_up(rep, first=True)
        self.sup.post(RecoveryFinished(ok, detail))

    async def recover(self, rep: Replica, old: Generation, event: EngineFailed) -> None:
        sup, builder = self.sup, self.sup.builder
        started = time.monotonic()
        record = rep.record
        if record is None or record.from_generation != old.number:
            record = rep.record = RecoveryRecord(rep.index, old.number, event)
        phases = record.phases
        phases["detect"] = max(0.0, started - event.detected_monotonic)
        try:
            t = time.monotonic()
            if event.kill_workers:  # a hang: the stuck workers go first (SIGKILL works on stopped ones)
                await asyncio.to_thread(builder.kill_stuck_workers, old)
            await self._drain_pumps(old)
            phases["drain"] = time.monotonic() - t
            t = record.teardown_monotonic = time.monotonic()
            await asyncio.to_thread(builder.teardown, old)
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
            sup.count_restart(record.reason, rep)
        closed = record.close(ok, rep.current.number if rep.current else 0, time.monotonic() - started)
        self.records.append(closed)
        if ok:
            sup.metrics.recovery(rep.index, closed["total_s"] + phases["detect"], phases)
        log.info("recovery finished", ok=ok, **{f"{k}_s": round(v, 3) for k, v in phases.items()},
                 total_s=round(closed["total_s"], 3))
        sup.post(RecoveryFinished(ok, detail))

    async def _bring_up(self, rep: Replica, first: bool, phases: dict[str, float] | None = None) -> tuple[bool, str]:
        """Place ``rep``'s workers and build engines until one is up, the restart budget is
        spent, or a stop is requested. Returns (ok, detail)."""
        sup, builder, standby = self.sup, self.sup.builder, self.sup.standby
        phases = phases if phases is not None else {}
        attempt = 0
        while True:
            cfg = sup.cfg  # a reload applies at once
            if sup.state is State.STOPPING:
                return True, "stopping"
            if builder.uses_ray and sup.ray.cluster_lost:
                t = time.monotonic()
                ok, detail = await sup.cluster.await_back()
                phases["ray_reconnect"] = phases.get("ray_reconnect", 0.0) + time.monotonic() - t
                if not ok or sup.state is State.STOPPING:
                    return ok, detail
            if (not first or attempt > 0) and not rep.intensity.record():
                spent = f"restart intensity exceeded: more than {cfg.max_restarts} restarts in {cfg.restart_window_s:g} s"
                if len(self.replicas) == 1:
                    return False, spent
                if not await self._wait_for_budget(rep, spent):
                    return False, f"replica {rep.index}: {spent}, and no other replica serves"
                continue  # stopping, or the budget has room again
            delay = backoff_s(attempt, cfg.restart_backoff_initial_s, cfg.restart_backoff_max_s)
            if delay:
                await asyncio.sleep(delay)
            attempt += 1
            number, gen = None, None
            try:
                t = time.monotonic()
                await asyncio.to_thread(sup.ray.ensure_placement_group, rep.index)
                phases["placement_group"] = time.monotonic() - t
                if self.reattach:  # made for the engine arguments a reload just replaced
                    await standby.discard("engine arguments changed")
                # The first build placed takes the standby's (reserved) number, whichever replica
                # it is for; no await between taking a number and claiming the standby.
                number = standby.reserved()
                if number is None:
                    number, self.next_generation = self.next_generation, self.next_generation + 1
                rep.building = number
                claim = await standby.claim(number)
                t = time.monotonic()
                gen = await asyncio.to_thread(builder.build, number, claim, rep.index)
                phases["engine_start"] = time.monotonic() - t
                if standby.enabled:  # while building still names it: a failure now dooms it
                    gen.standby = standby.adopted(number, await self._workers_of(gen), count=not (first and attempt == 1))
                    if rep.record is not None:
                        rep.record.standby = gen.standby
                if sup.client.model_config is None or self.reattach:  # first engine, or a reload changed it
                    front = await asyncio.to_thread(builder.front, gen.engine)
                    sup.client.attach(gen.engine, await gen.engine.get_supported_tasks(), front, gen.epoch)
                    self.reattach = False
                if held := await sup.client.hold_like_the_others(gen.engine):
                    log.info("new engine held as the others are", engine_generation=number, replica=rep.index, held=held)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                rep.building, rep.last_error = None, error[:300]
                sup.count_restart("build_failed", rep)
                log.error("engine build failed", failed_generation=number, replica=rep.index, error=error[:500])
                if type(exc).__name__ == "PlacementGroupTimeout" and sup.state is State.RECOVERING:
                    sup.machine.transition(State.RECOVERING, f"waiting for capacity: {exc}")
                if number is not None:  # not placed: no number taken, nothing built
                    standby.build_failed(number)
                    if gen is not None:  # built, then a step after it failed: its engine goes too
                        await self._discard(gen)
                    await asyncio.to_thread(builder.cleanup_failed_build, number)
                continue
            rep.building = None
            if number in self._doomed or sup.state is State.STOPPING:
                self._doomed.discard(number)
                await self._discard(gen)
                if sup.state is State.STOPPING:
                    return True, "stopping"
                sup.count_restart("build_failed", rep)
                continue
            gen.replica = rep.index
            rep.current, rep.served, rep.last_error = gen, True, ""
            verb = "up" if first and attempt == 1 else "recovered"
            self._replica_up(rep, f"engine generation {number} {verb} in {gen.build_s:.1f} s")
            if standby.prepare(self.next_generation, gen.engine.vllm_config, rep.index):
                self.next_generation += 1  # reserved for the standby: the next build placed takes it
            return True, ""

    async def _wait_for_budget(self, rep: Replica, spent: str) -> bool:
        """``rep``'s restart budget is spent: while another replica serves or is on its way up
        (starting or recovering, its budget not spent), ``rep`` waits until its budget allows
        one more restart ("waiting" in its status, the ``replica_restart_budget_spent``
        metric). True: try again (or stopping); False: no other replica serves or can, the
        daemon fails."""
        sup = self.sup
        others = [r for r in self.replicas if r is not rep]
        rep.retry_at = time.monotonic() + rep.intensity.free_in()
        sup.metrics.replica_budget_spent.labels(str(rep.index)).set(1)
        log.error("replica's restart budget spent; the others serve, it waits to retry", replica=rep.index,
                  reason=spent, retry_in_s=round(rep.retry_at - time.monotonic(), 1), last_error=rep.last_error,
                  serving=[r.index for r in others if r.serving()])
        sup.notifier.status(f"{sup.state.value}: replica {rep.index} waiting: {spent}")
        sup.changed.set()
        try:
            while (left := rep.retry_at - time.monotonic()) > 0:
                if sup.state is State.STOPPING:
                    return True
                if not any(r.serving() or (r.busy and r.retry_at is None) for r in others):
                    return False
                await asyncio.sleep(min(1.0, left))
            log.info("replica's restart budget has room again; retrying", replica=rep.index)
            return True
        finally:
            rep.retry_at = None
            sup.metrics.replica_budget_spent.labels(str(rep.index)).set(0)
            sup.changed.set()

    async def _workers_of(self, gen: Generation) -> list[dict[str, Any]]:
        try:
            return await aio.wait_for(asyncio.to_thread(self.sup.ray.workers, gen.instance_id), 10)
        except Exception as exc:
            log.warning("could not list the new generation's workers", error=str(exc))
            return []

    async def _discard(self, gen: Generation) -> None:
        await asyncio.to_thread(self.sup.builder.teardown, gen)
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

    async def stop(self, operation: asyncio.Task | None) -> None:
        """Drain (bounded), let the builds under way (and ``operation``) finish, tear every
        replica down, stop the standby and release the cluster; then ``StopFinished``."""
        sup, client = self.sup, self.sup.client
        try:
            if client.in_flight and sup.exit_code == EXIT_OK and any(r.current for r in self.replicas):
                timeout = sup.cfg.drain_timeout_s
                log.info("draining", in_flight=client.in_flight, timeout_s=timeout)
                try:
                    await aio.wait_for(client.idle.wait(), timeout)
                except asyncio.TimeoutError:
                    log.warning("drain deadline passed", in_flight=client.in_flight)
            # let engine builds in progress finish, then drop them
            running = {t for t in [operation, *(r.recovery for r in self.replicas)] if t is not None and not t.done()}
            if running:
                await asyncio.wait(running, timeout=sup.cfg.recovery_timeout_s)
            for rep in self.replicas:
                gen, rep.current = rep.current, None
                sup.metrics.replica(rep.index, up=False, generation=0)
                if gen is not None:
                    gen.interrupt_streams()
                    await asyncio.to_thread(sup.builder.teardown, gen)
                    await gen.reap_lingering()
            try:  # bounded (the fork server is killed, not waited for); never skips the release below
                await aio.wait_for(sup.standby.stop(), 30)
            except Exception:
                log.exception("could not stop the standby")
            await asyncio.to_thread(sup.ray.release)
        except Exception:
            log.exception("error while stopping")
        finally:
            sup.post(StopFinished())
