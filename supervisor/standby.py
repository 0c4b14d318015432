"""The warm standby: what the next engine generation can adopt, prepared while this one serves.

Two parts, both started after a generation is READY and both owned by this daemon:

* the engine core's fork server (``executor.forkserver``): vLLM imported once; each next
  engine core forks from it instead of spawning an interpreter that imports vLLM again;
* one standby worker actor per rank (``executor.standby``, Ray executor only): a Ray worker
  process with vLLM and the model's module imported, named and placed as the next
  generation's worker of that rank, holding no resources until the executor adopts it.

With replicas there is one standby for all of them: a generation number is reserved for it
when it is prepared, and the first build placed, whichever replica it is for, takes that
number (``take``) and claims it (the workers
are placed by node, ``executor.standby``, so any replica's placement group on that node can
adopt them). One standby, not one per replica: a replica's recovery is what it speeds up,
two replicas rarely fail within the ~10 s it takes to prepare the next, and each one would
cost a worker's memory per rank while nothing fails (``docs/replicas.md``).

The standby has its own small state machine (``TRANSITIONS``). A standby part that dies is
replaced and counted; it is never a serving failure. A build that cannot adopt it (dead, or
placed on a node the build's placement group does not use) creates its workers cold instead.
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Any

from supervisor import logs, standby_sched, testhooks
from supervisor.process_exits import ProcessExits
from supervisor.standby_workers import StandbyWorkers

log = logs.get_logger("vllm_supervisor.standby")

# How often the ready standby's liveness is read from Ray's actor table: while a part runs on another
# node (POLL_S), and as a check besides waiting on the exits of those on this host (CHECK_S).
POLL_S = 1.0
CHECK_S = 30.0
RETRY_S = (1.0, 30.0)  # backoff after a failed preparation: first, max
# The first seconds after a generation comes up belong to the streams it resumes: their prompts
# and tokens so far are computed again, and preparing at once (a Ray worker start and vLLM's
# import, ≈ 8 s of CPU a rank) took cores from that. A failure meanwhile is built without
# workers to adopt, as it would be while they start.
SETTLE_S = 3.0


class StandbyState(str, enum.Enum):
    OFF = "off"  # disabled, consumed by a build, or the daemon is stopping
    PREPARING = "preparing"  # fork server and/or actors starting (also: replacing a dead part)
    READY = "ready"  # every part is up and idle
    ADOPTING = "adopting"  # a build of its generation is taking it over
    UNAVAILABLE = "unavailable"  # preparing failed; retried with backoff


TRANSITIONS: dict[StandbyState, frozenset[StandbyState]] = {
    StandbyState.OFF: frozenset({StandbyState.PREPARING}),
    StandbyState.PREPARING: frozenset({StandbyState.READY, StandbyState.ADOPTING, StandbyState.UNAVAILABLE,
                                       StandbyState.OFF}),
    StandbyState.READY: frozenset({StandbyState.PREPARING, StandbyState.ADOPTING, StandbyState.UNAVAILABLE,
                                   StandbyState.OFF}),
    StandbyState.ADOPTING: frozenset({StandbyState.OFF}),
    StandbyState.UNAVAILABLE: frozenset({StandbyState.PREPARING, StandbyState.OFF}),
}


class Standby:
    """Prepared by the owner after each READY (``prepare``), claimed by the next build
    (``claim``), reported on by that build (``adopted``)."""

    def __init__(self, host: StandbyWorkers, metrics: Any, enabled: bool):
        self.host = host  # the fork server and the standby's worker actors
        self.metrics = metrics
        self.enabled = enabled
        self.state = StandbyState.OFF
        self.generation = 0  # the generation number this standby is for
        self.replica = 0  # the replica whose placement group's nodes it was placed on
        self._unclaimed: int | None = None  # its number, reserved, until a build takes it
        self.workers: list[dict[str, Any]] = []  # rank, name, actor_id, bundle, pid, state
        self.forkserver_pid: int | None = None
        self.replacements = 0
        self.adoptions: dict[str, int] = {"adopted": 0, "cold": 0}
        self.ready_after_s: float | None = None  # the settle's end → READY, last time
        self.watch = ""  # how the ready standby's death is seen: "exits" (waited on) or "polled"
        # The standby's processes on this host under SCHED_IDLE while it is ready
        # (``standby_sched``). The claim of the build it is kept for takes them all back; any
        # other build's claim takes the fork server back, and the fork server does not rest
        # again while such a build may still fork from it (``_forking``: their generations).
        self.resting: list[int] = []
        # Its workers on this host stopped (SIGSTOP) while it is ready (``standby_sched.stop``):
        # continued by any claim that takes them, and before any discard kills them.
        self.stopped: list[int] = []
        self._forking: set[int] = set()
        self.last_error = ""
        self._task: asyncio.Task | None = None
        self._creating = asyncio.Lock()
        self._without = testhooks.standby_without()  # parts left out, for a bench only
        metrics.set_standby(self.state.value)

    # --- state ------------------------------------------------------------------------

    def _to(self, new: StandbyState, reason: str) -> None:
        if new is self.state:
            return
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"standby {self.state.value} -> {new.value} is not allowed ({reason})")
        log.info("standby state", from_state=self.state.value, to_state=new.value, for_generation=self.generation,
                 reason=reason)
        self.state = new
        self.metrics.set_standby(new.value)

    def status(self) -> dict[str, Any]:
        return {
            "mode": "warm" if self.enabled else "none",
            "state": self.state.value,
            "for_generation": self.generation,
            "forkserver_pid": self.forkserver_pid,
            "workers": [{k: w.get(k) for k in ("rank", "name", "pid", "state")} for w in self.workers],
            "ready_after_s": None if self.ready_after_s is None else round(self.ready_after_s, 2),
            "watch": self.watch if self.state is StandbyState.READY else "",
            "resting": list(self.resting),
            "stopped": list(self.stopped),
            "replacements": self.replacements,
            "adoptions": dict(self.adoptions),
            **({"last_error": self.last_error} if self.last_error else {}),
        }

    @property
    def creates_workers(self) -> bool:
        """Whether this standby (and each build's ``starter``) creates worker actors through the
        Ray agent: a warm standby on Ray's executor (without Ray, the fork server only)."""
        return self.enabled and self.host.uses_ray

    @property
    def preloads_worker_class(self) -> bool:
        """Whether the Ray agent imports the workers' class ahead of their first creation (unless
        a bench left that out: ``testhooks.standby_without``)."""
        return self.creates_workers and "preload" not in self._without

    # --- the owner's calls ----------------------------------------------------------------

    def prepare(self, generation: int, vllm_config: Any, replica: int = 0) -> bool:
        """Start preparing the standby for generation number ``generation``, on the nodes of
        ``replica``'s placement group (the replica that just came up). True when it started:
        the owner then reserves that number for it (``reserved``)."""
        if not self.enabled or self.state is not StandbyState.OFF or "idle" in self._without:
            return False
        self.generation, self.replica, self._unclaimed = generation, replica, generation
        self._to(StandbyState.PREPARING, f"a generation came up (replica {replica})")
        self._task = asyncio.create_task(self._run(generation, vllm_config))
        return True

    def reserved(self) -> int | None:
        """The number reserved for the standby that no build has taken yet: the next build
        takes it (``take``, at once), so numbers have no gaps even
        when the standby was dropped meanwhile. None: take a new one."""
        return self._unclaimed if self.enabled else None

    def take(self, generation: int) -> None:
        """The owner took ``generation`` for a build: a reserved number is taken once."""
        if generation == self._unclaimed:
            self._unclaimed = None

    async def claim(self, generation: int) -> dict[str, Any] | None:
        """The standby for the build of ``generation``: ``{"namespace", "forkserver"}``
        (``namespace`` None when there are no standby workers for it), or None when there is
        nothing to adopt. The build of the standby's number (``reserved``) consumes it; any
        other build (one numbered while it was being adopted) leaves it alone and gets the
        fork server only."""
        if not self.enabled:
            return None
        if generation == self._unclaimed:
            self._unclaimed = None
        mine = generation == self.generation and self.state in (StandbyState.PREPARING, StandbyState.READY)
        busy = not mine and self.state in (StandbyState.PREPARING, StandbyState.READY, StandbyState.ADOPTING)
        if mine:  # decided before the first await: no other build can take it meanwhile
            self._to(StandbyState.ADOPTING, f"building generation {generation}")
        # Any build forks its engine core from the fork server, and this one may adopt the
        # workers: back at the normal policy, before the first await. A build that is not the
        # standby's own only forks: its workers rest on for the build they are kept for, and
        # the fork server does not rest again until that build is built or has failed.
        if not mine:
            self._forking.add(generation)
        self._take_back(only=[self.forkserver_pid] if busy else None)
        if busy:
            return {"namespace": None, "forkserver": await asyncio.to_thread(self.host.forkserver_alive)}
        async with self._creating:  # an actor creation in flight finishes first
            await self._cancel()
        if mine and self.workers:  # parked ones wake before the build calls them
            missed = await asyncio.to_thread(self.host.wake, self.workers)
            if missed:
                log.warning("could not wake a parked standby worker; the build's first call to it waits "
                            "for its park to end (executor.standby.PARK_S)", missed=missed)
        forkserver = await asyncio.to_thread(self.host.forkserver_alive)
        if not mine:
            if self.state is StandbyState.UNAVAILABLE:
                self._to(StandbyState.OFF, f"building generation {generation} without it")
            return {"namespace": None, "forkserver": forkserver}
        return {"namespace": self.host.namespace if self.workers else None, "forkserver": forkserver}

    def starter(self, generation: int, replica: int) -> Any:
        """What the build of ``generation`` starts its own workers with when it has none of the
        standby's to adopt (``StandbyWorkers.starter``): with a warm standby only (the Ray agent
        holds vLLM's import for it anyway); None with ``standby = "none"``."""
        return self.host.starter(generation, replica) if self.enabled and "starter" not in self._without else None

    def adopted(self, generation: int, serving_workers: list[dict[str, Any]], count: bool = True) -> dict[str, Any]:
        """After a successful build: which ranks run in a standby's process. ``count``: false
        for the daemon's first engine, which has no standby to adopt."""
        self._forking.discard(generation)  # its engine core is forked
        mine = self._adopted_by(generation)
        ids = {w["actor_id"]: w for w in self.workers} if mine else {}
        adopted = sorted(w["rank"] for w in serving_workers if w.get("actor_id") in ids)
        result = "adopted" if adopted and len(adopted) == len(serving_workers) else "cold"
        if self.enabled and count:
            self.adoptions[result] += 1
            self.metrics.standby_adoptions.labels(result).inc()
        if mine:
            # The adopted actors belong to the generation now (the Ray agent keeps their handles
            # until the generation's actors are killed: Ray ends an actor whose creator drops them).
            self.workers = []
            self._to(StandbyState.OFF, f"generation {generation} built ({result})")
        return {"result": result, "adopted_ranks": adopted}

    def _adopted_by(self, generation: int) -> bool:
        """Whether the build of ``generation`` is the one that claimed this standby (only its
        own number's build moves it to ADOPTING)."""
        return self.state is StandbyState.ADOPTING and generation == self.generation

    def build_failed(self, generation: int) -> None:
        """The build of ``generation`` failed; if it claimed the standby, its cleanup killed
        what it adopted (the standby's workers carry that generation's names)."""
        self._forking.discard(generation)
        if self._adopted_by(generation):
            self.workers = []
            self._to(StandbyState.OFF, "the build that claimed it failed")

    async def stop(self) -> None:
        async with self._creating:
            await self._cancel()
        try:
            await self._discard_workers()
        except Exception as exc:  # the Ray agent gone: the workers went with it or its job
            log.warning("could not kill the standby's workers", error=str(exc)[:300])
        if self.state is not StandbyState.OFF:
            self._to(StandbyState.OFF, "stopping")
        if self.enabled:
            await asyncio.to_thread(self.host.stop_forkserver)
        self.forkserver_pid = None

    async def cluster_lost(self) -> None:
        """The Ray cluster is gone and its standby workers with it: forget them (no Ray call).
        The fork server is local and stays; the next READY prepares workers again."""
        async with self._creating:  # a creation in flight fails as the Ray agent is killed
            await self._cancel()
        self._continue_workers()  # one that outlived its cluster ends as any of its workers does
        self.workers = []
        if self.state is not StandbyState.OFF:
            self._to(StandbyState.OFF, "the Ray cluster was lost")

    async def discard(self, reason: str) -> None:
        """Drop the standby (a reload changed the engine arguments it was made for)."""
        async with self._creating:
            await self._cancel()
        await self._discard_workers()
        if self.state is not StandbyState.OFF:
            self._to(StandbyState.OFF, reason)

    # --- the standby's own task -----------------------------------------------------------------

    async def _cancel(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _discard_workers(self) -> None:
        self._continue_workers()  # a stopped actor would take Ray 5 s to kill (its SIGKILL fallback)
        workers, self.workers = self.workers, []
        if workers:
            await asyncio.to_thread(self.host.kill, workers)

    async def _run(self, generation: int, vllm_config: Any) -> None:
        await asyncio.sleep(SETTLE_S)
        started = time.monotonic()
        failures = 0
        while True:
            try:
                await self._make_ready(generation, vllm_config, started)
                await self._watch(generation, vllm_config)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                log.warning("standby preparation failed", error=self.last_error, attempt=failures)
                try:
                    await self._discard_workers()
                except Exception as discard_exc:  # Ray unreachable: the owner's stop cleans up
                    log.warning("could not discard the standby's workers", error=str(discard_exc))
                self._to(StandbyState.UNAVAILABLE, self.last_error)
                await asyncio.sleep(min(RETRY_S[1], RETRY_S[0] * 2 ** (failures - 1)))
                self._to(StandbyState.PREPARING, "retrying")

    async def _make_ready(self, generation: int, vllm_config: Any, started: float) -> None:
        if not await asyncio.to_thread(self.host.forkserver_alive):
            took = await asyncio.to_thread(self.host.start_forkserver)
            log.info("standby engine-core fork server ready", took_s=round(took, 2))
        self.forkserver_pid = await asyncio.to_thread(self.host.forkserver_pid)
        if self.host.uses_ray and not self.workers:
            async with self._creating:
                self.workers = await asyncio.to_thread(self.host.create, generation, vllm_config,
                                                       self.replica)
        while self.host.uses_ray:
            states = await asyncio.to_thread(self.host.states, self.workers)
            for w, s in zip(self.workers, states):
                w.update(state=s["state"], pid=s["pid"], local=s.get("local", False))
            dead = [s for s in states if s["state"] == "DEAD"]
            if dead:
                raise RuntimeError(f"a standby worker died while starting: {dead[0]['death'] or 'no cause'}")
            if all(s["state"] == "ALIVE" for s in states):
                break
            await asyncio.sleep(POLL_S / 2)
        if self.host.uses_ray and "park" not in self._without:
            # Not under the creation's lock: a claim must not wait for a standby that does not
            # answer. One that lands while this call is in flight may find a worker parked after
            # its wake-up; the build's first call to it then waits for that park's end (PARK_S).
            try:
                await asyncio.to_thread(self.host.park, self.workers)
            except Exception as exc:  # not parked: it waits as an actor does, awake
                log.warning("could not park the standby's workers; they wait awake",
                            error=f"{type(exc).__name__}: {exc}"[:300])
        self.ready_after_s = time.monotonic() - started
        self._to(StandbyState.READY, f"ready in {self.ready_after_s:.1f} s")
        if "rest" not in self._without:  # in the same turn of the loop as READY: no claim between
            parts = self._part_pids()[0].values()
            rested, left = standby_sched.rest([p for p in parts if not (self._forking and p == self.forkserver_pid)])
            self.resting = sorted(set(rested) | {p for p in self.resting if standby_sched.threads(p)})
            if left:
                log.info("the standby waits at the normal scheduling policy: taking it back from SCHED_IDLE needs "
                         "CAP_SYS_NICE or an RLIMIT_NICE of 20 (systemd: LimitNICE=+0)", pids=left)
        if "freeze" not in self._without:  # its workers on this host; the fork server sleeps anyway
            workers = [pid for pid in self._part_pids()[0].values() if pid != self.forkserver_pid]
            self.stopped = standby_sched.stop(workers)  # none before: every discard continued and forgot them
        log.info("standby ready", for_generation=generation, took_s=round(self.ready_after_s, 2),
                 forkserver_pid=self.forkserver_pid, worker_pids=[w.get("pid") for w in self.workers],
                 resting=self.resting, stopped=self.stopped)

    def _continue_workers(self, only: list[int | None] | None = None) -> None:
        """Every stopped worker (or those in ``only``) continued (``standby_sched.cont``) and
        forgotten as stopped: before a build takes them, or the standby lets them go."""
        stopped = [p for p in self.stopped if only is None or p in only]
        self.stopped = [p for p in self.stopped if p not in stopped]
        standby_sched.cont(stopped)

    def _take_back(self, only: list[int | None] | None = None) -> None:
        """Every process ``rest`` set to SCHED_IDLE (or those of them in ``only``) back to the normal
        policy, and continued if it was stopped (``standby_sched``). On the event loop, as ``rest``:
        a system call per thread, well under a millisecond for a standby's few processes, and no
        claim can land between the policy and its record."""
        resting = [p for p in self.resting if only is None or p in only]
        self.resting = [p for p in self.resting if p not in resting]
        refused = standby_sched.restore(resting)
        self._continue_workers(only)  # at the normal policy already when it runs again
        if refused:
            log.warning("could not take the standby's processes back to the normal scheduling policy; "
                        "what is built in them keeps the resting one", pids=refused)

    async def _watch(self, generation: int, vllm_config: Any) -> None:
        """Until claimed: a dead part is replaced (never a serving failure)."""
        if "poll" in self._without:
            await asyncio.Event().wait()  # until claimed (cancelled)
        while True:
            lost = await self._until_lost()
            self.replacements += 1
            self.metrics.standby_replacements.inc()
            log.warning("standby died; replacing it (not a serving failure)", lost=lost, for_generation=generation)
            self._to(StandbyState.PREPARING, f"replacing: {lost[0][:150]}")
            await self._discard_workers()
            await self._make_ready(generation, vllm_config, time.monotonic())

    def _part_pids(self) -> tuple[dict[str, int], bool]:
        """The ready standby's processes on this host (name → pid): the fork server and the
        workers Ray placed on this node; and whether that is every part."""
        parts = [("engine-core fork server", self.forkserver_pid, True)]
        if self.host.uses_ray:
            parts += [(f"worker {w['name']}", w.get("pid"), bool(w.get("local"))) for w in self.workers]
        pids = {name: pid for name, pid, local in parts if pid and local}
        return pids, len(pids) == len(parts)

    async def _until_lost(self) -> list[str]:
        """What of the ready standby died, once something did. Its processes on this host are
        waited on (``ProcessExits``), not polled; Ray's actor table is read once an exit is
        seen, every ``CHECK_S`` besides, and every ``POLL_S`` while a part runs on another node
        (or this host has no pidfds)."""
        pids, every_part = self._part_pids()
        try:
            exits = ProcessExits(pids)
        except OSError as exc:
            log.warning("cannot wait on the standby's processes; polling them", error=str(exc)[:200])
            exits, every_part = ProcessExits({}), False
        self.watch = "exits" if every_part else "polled"
        with exits:
            while True:
                exited = await exits.wait(CHECK_S if every_part else POLL_S)
                lost = [f"{name} (pid {pids[name]}) exited" for name in exited]
                if not lost and not await asyncio.to_thread(self.host.forkserver_alive):
                    lost.append("engine-core fork server")
                if self.host.uses_ray:
                    states = await asyncio.to_thread(self.host.states, self.workers)
                    for w, s in zip(self.workers, states):
                        if s["state"] == "DEAD":
                            lost.append(f"worker {w['name']} (pid {w.get('pid')}): {s['death'] or 'no cause'}")
                if lost:
                    return lost
