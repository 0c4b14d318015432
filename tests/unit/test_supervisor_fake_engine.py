"""The supervisor's lifecycle against a fake engine: recovery, continuation, admission,
restart intensity, hang detection and a fault during the first start. No Ray, no vLLM engine
(only vLLM's ``SamplingParams`` and ``EngineDeadError`` types)."""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

from config import load_settings
from config.exitcodes import EXIT_FAILED
from supervisor.daemon import EngineUnavailable, Generation, RequestFailed, Supervisor
from supervisor.dispatch import ready
from supervisor.events import EngineFailed, ReloadRequested, SignalReceived
from supervisor.standby_workers import StandbyWorkers
from supervisor.states import State


def next_token(context: list[int]) -> int:
    """Deterministic 'greedy decoding': depends on the whole context."""
    return (sum(context) * 31 + len(context)) % 509


def reference(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


class FakeEngine:
    def __init__(self, step_s: float = 0.005):
        self.step_s = step_s
        self.errored = False
        self.hung = asyncio.Event()
        self.dead = asyncio.Event()
        self.shut = False
        self.requests_seen: list = []
        # vLLM's output processor, in the one part the supervisor uses: waking every stream
        # waiting for an output with an error, in one hop, as its collectors do
        self.output_processor = SimpleNamespace(propagate_error=self._propagate_error)
        self._error: BaseException | None = None
        self._waits: set[asyncio.Future] = set()

    vllm_config = model_config = SimpleNamespace()

    def _propagate_error(self, exc):
        self._error = exc
        for fut in self._waits:
            if not fut.done():
                fut.set_result(None)

    async def _wait(self, seconds):
        """The engine's next step in ``seconds``, or an error propagated before it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        timer = loop.call_later(seconds, lambda: fut.done() or fut.set_result(None))
        self._waits.add(fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waits.discard(fut)
        if self._error is not None:
            raise self._error

    def get_tokenizer(self):
        return object()

    async def get_supported_tasks(self):
        return ("generate",)

    def shutdown(self, timeout=None):
        self.shut = True

    def die(self):
        self.errored = True
        self.dead.set()

    # vLLM's sleep mode and pause, as the engine client forwards them
    held: list = None
    on_hold = None  # test hook: called with the call's name as it happens

    async def _record(self, *call):
        self.held = (self.held or []) + [call]
        if (hook := type(self).on_hold) is not None:  # read on the class: a plain function
            hook(self, call[0])

    async def sleep(self, level=1, mode="abort"):
        self.sleeping = {"weights", "kv_cache"}
        await self._record("sleep", level)

    async def wake_up(self, tags=None):
        self.sleeping = getattr(self, "sleeping", set()) - set(tags or ("weights", "kv_cache"))
        await self._record("wake_up", tags)
        return True

    async def is_sleeping(self):
        return bool(getattr(self, "sleeping", None))

    async def pause_generation(self, **kwargs):
        await self._record("pause_generation", kwargs)

    async def resume_generation(self):
        await self._record("resume_generation")

    async def generate(self, prompt, params, request_id):
        try:
            async for out in self._generate(prompt, params):
                yield out
        except asyncio.CancelledError:
            if self.errored:  # like AsyncLLM: abort the request, which a dead engine never answers
                await asyncio.sleep(3600)
            raise

    async def _generate(self, prompt, params):
        ctx = list(prompt["prompt_token_ids"])
        detok, sent = FakeDetokenizer(params), 0  # like vLLM's output processor
        for i in range(params.max_tokens):
            if self.dead.is_set():
                raise EngineDeadError()
            while self.hung.is_set():
                await self._wait(3600)
            await self._wait(self.step_s)
            if self.dead.is_set():
                raise EngineDeadError()
            tok = next_token(ctx)
            ctx.append(tok)
            self.requests_seen.append(params)
            stop = detok.update([tok], False)
            done = "stop" if stop else "length" if i == params.max_tokens - 1 else None
            full = detok.get_next_output_text(done is not None, False)
            # A fresh engine's detokenizer is cold at the seam: its text must never reach the client.
            text, sent = (full[sent:] if params.detokenize else "COLD"), len(full)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[tok], text=text, finish_reason=done,
                                                           stop_reason=stop)],
                                  finished=done is not None, prompt_token_ids=prompt["prompt_token_ids"],
                                  prompt=None, prompt_logprobs=None)
            if done:
                return


class FakeDetokenizer:
    """The part of vLLM's incremental detokenizer that ``SeamText`` drives: token ``t`` reads
    ``<t>``; stop strings are found on the joined text, whose last ``len(stop) - 1`` characters
    are held back until the request finishes."""

    def __init__(self, params):
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop = list(params.stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def output_token_ids(self):
        return self.token_ids

    def num_output_tokens(self):
        return len(self.token_ids)

    def update(self, new_ids, stop_terminated):
        for tok in new_ids:
            self.token_ids.append(tok)
            self.output_text += f"<{tok}>"
            for stop in self.stop:
                at = self.output_text.find(stop)
                if at >= 0:
                    self.output_text = self.output_text[:at]
                    return stop
        return None

    def get_next_output_text(self, finished, delta):
        return self.output_text if finished or not self.hold else self.output_text[: -self.hold]


def fake_detokenizer(tokenizer, prompt_token_ids, params, request_id):
    """The request path's seam detokenizer over the fake engines' tokens."""
    return FakeDetokenizer(params)


def fake_args(**changes):
    """The parts of vLLM's serve Namespace the owner reads."""
    return SimpleNamespace(**{"api_key": None, "model": "/fake", "served_model_name": ["fake"], "host": "127.0.0.1",
                              "port": 8000, "max_model_len": 256, **changes})


class FakeRayLink:
    """``supervisor.raylink.RayLink`` without Ray: a cluster that connects, is lost and answers."""

    gcs_address = ""  # the cluster-loss tests point it at a TCP server of their own
    cluster_lost = released = False
    agent_up = True
    agent_pid = None
    predecessor_id = ""

    def __init__(self, serving: dict[int, str]):
        self.killed_instances: list[str] = []  # kill_actors' instance ids
        self.cluster = None
        self.connects = 0
        self.serving = serving  # the builder's: generation -> actor id of its worker

    def agent_alive(self):
        return self.agent_up

    def connect(self):
        self.cluster = SimpleNamespace(started_local=False, reachable=lambda: True)
        self.cluster_lost = False
        self.agent_up = True
        self.connects += 1

    def mark_lost(self):
        if self.cluster is None or self.cluster_lost:
            return False
        self.cluster_lost = True
        return True

    def kill_agent(self):
        return []

    def ensure_placement_group(self, replica=0):
        pass

    def release(self):
        pass

    def kill_actors(self, instance_id):
        self.killed_instances.append(instance_id)
        return []

    def workers(self, instance_id):
        number = int(instance_id.rsplit("-g", 1)[1])
        actor_id = self.serving.get(number)
        return [{"rank": 0, "name": f"w-g{number}", "actor_id": actor_id}] if actor_id else []

    def reachable(self):
        return self.cluster.reachable()



class FakeStandbyWorkers:
    """``supervisor.standby_workers.StandbyWorkers`` simulated on its builder's state: a fork
    server flag and one "actor" per standby (which ``FakeBuilder.build`` adopts)."""

    namespace = "fake-ns"

    def __init__(self, builder):
        self.b = builder

    uses_ray = property(lambda self: self.b.uses_ray)

    def start_forkserver(self):
        self.b.forkserver_up = True
        return 0.01

    def forkserver_alive(self):
        return self.b.forkserver_up

    def forkserver_pid(self):
        return None  # no process to wait on: the standby reads forkserver_alive instead

    def stop_forkserver(self):
        self.b.forkserver_up = False

    def create(self, number, vllm_config, replica=0):
        actor_id = f"a{len(self.b.standby_made)}"
        self.b.actor_states[actor_id] = "ALIVE"
        worker = {"rank": 0, "name": f"w-g{number}", "actor_id": actor_id, "bundle": 0, "handle": None}
        self.b.standby_made.append(worker)
        return [dict(worker)]

    def states(self, workers):
        return [{"state": self.b.actor_states.get(w["actor_id"], "DEAD"), "pid": 100 + int(w["actor_id"][1:]), "death": ""}
                for w in workers]

    def kill(self, workers):
        for w in workers:
            self.b.actor_states[w["actor_id"]] = "DEAD"

    def park(self, workers):
        for w in workers:
            self.b.parked.add(w["actor_id"])
            w["wake"] = ("127.0.0.1", 9)

    def wake(self, workers):
        for w in workers:
            if w["actor_id"] in self.b.parked:
                self.b.parked.discard(w["actor_id"])
                self.b.woken.append(w["actor_id"])
        return []

    starter = StandbyWorkers.starter  # the real one, on these fake actors

    def class_import(self):
        return {"asked": False}
    ray = property(lambda self: self.b.ray)
    instance_id = staticmethod(lambda number: f"fake-g{number}")


class FakeBuilder:
    """``supervisor.builder.EngineBuilder`` without Ray or vLLM: fake engines, instant teardown;
    its ``ray`` is a ``FakeRayLink``."""

    world_size = 1
    uses_ray = True
    config_epoch = 0
    model_path, served_model_name = "/fake", "fake"
    abandoned = False

    def __init__(self, build_failures: int = 0):
        self.cut_short: set[int] = set()
        self.engines: list[FakeEngine] = []
        self.build_failures = build_failures
        self.torn_down: list[int] = []
        self.engine_args = fake_args()
        self.claims: list = []
        self.forkserver_up = False
        self.standby_made: list[dict] = []
        self.started_early: list[dict] = []  # workers builds started for themselves (StandbyWorkers.starter)
        self.actor_states: dict[str, str] = {}
        self.parked: set[str] = set()  # standby actors parked and not woken (StandbyWorkers.park)
        self.woken: list[str] = []
        self.adopted_parked: list[str] = []  # adopted while still parked: the build would have waited
        self.serving: dict[int, str] = {}  # generation -> actor id of its worker
        self.ray = FakeRayLink(self.serving)
        self.standby_workers = FakeStandbyWorkers(self)

    def prepare_model(self):
        pass

    def build(self, number, standby=None, replica=0, start_workers=None):
        time.sleep(0.05)
        self.claims.append((number, standby))
        namespace = (standby or {}).get("namespace")
        if namespace is None and start_workers is not None:  # what executor.engine.build_engine does
            made = len(self.standby_made)
            namespace = start_workers(SimpleNamespace())
            self.started_early += self.standby_made[made:]  # kept apart from the warm standby's
            del self.standby_made[made:]
        if self.build_failures > 0:
            self.build_failures -= 1
            raise RuntimeError("engine core initialization failed (fake)")
        engine = FakeEngine()
        self.engines.append(engine)
        # what the executor does: adopt the live standby named for this generation, else cold
        live = [w for w in self.standby_made + self.started_early
                if w["name"] == f"w-g{number}" and self.actor_states[w["actor_id"]] == "ALIVE"]
        self.serving[number] = live[-1]["actor_id"] if namespace and live else f"cold-{number}"
        if self.serving[number] in self.parked:
            self.adopted_parked.append(self.serving[number])
        return Generation(number, f"fake-g{number}", engine, set(), 0.05, replica=replica, epoch=self.config_epoch)

    def front(self, engine):
        return SimpleNamespace(get_tokenizer=lambda: object()), None

    def cleanup_failed_build(self, number):
        pass

    def abandon_builds(self, wait_s=30.0):
        self.abandoned = True  # a fake build takes 0.05 s: nothing to cut short
        return []

    def teardown(self, gen):
        gen.engine.shutdown()
        self.torn_down.append(gen.number)

    def kill_stuck_workers(self, gen):
        pass

    def sweep_deferred(self, wait_s=0.0):
        return []

    def sweep_sockets(self, wait_s=10.0):
        return []


class FakeSupervisor(Supervisor):
    """The real owner and request path over a ``FakeBuilder`` (with its ``FakeRayLink`` and
    ``FakeStandbyWorkers``)."""

    def __init__(self, settings, build_failures: int = 0, reload_settings=None, builder=None, detokenizer=fake_detokenizer):
        builder = builder or FakeBuilder(build_failures)
        builder.ray.settings = settings.ray  # what RayLink is built with: the start's ray settings
        super().__init__(settings, builder.engine_args, registry=CollectorRegistry(),
                         reload_settings=reload_settings, builder=builder, standby_workers=builder.standby_workers)
        if detokenizer is not None:  # None: vLLM's, over the request path's real tokenizer
            self.client.new_detokenizer = detokenizer

    engines = property(lambda self: self.builder.engines)
    torn_down = property(lambda self: self.builder.torn_down)

    @property
    def build_failures(self):
        return self.builder.build_failures

    @build_failures.setter
    def build_failures(self, n):
        self.builder.build_failures = n


def settings(tmp_path, **supervisor):
    base = {"probe_interval_s": 0.05, "hang_timeout_s": 0.5, "probe_timeout_s": 0.5, "probe_failure_threshold": 2,
            "restart_backoff_initial_s": 0.01, "restart_backoff_max_s": 0.05, "admission_timeout_s": 5}
    base.update(supervisor)
    return load_settings(None, {f"supervisor.{k}": v for k, v in base.items()}, environ={})


async def wait_for(predicate, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def collect(sup, prompt, n, on_token=None, text=None, **params):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **params)
    got = []
    async for out in sup.client.generate({"prompt_token_ids": prompt}, params, "req"):
        got += out.outputs[0].token_ids
        if text is not None:
            text.append((out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason))
        if on_token:
            on_token(len(got))
    return got


def run(coro):
    return asyncio.run(coro)


def test_worker_death_mid_stream_continues_exactly(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)

        def kill_at_7(n):
            if n == 7:
                sup.engines[0].die()
                sup.post(EngineFailed(1, "worker_death", "rank 0 killed"))

        text = []
        got = await collect(sup, [1, 2, 3], 30, kill_at_7, text=text)
        assert got == reference([1, 2, 3], 30)
        assert "".join(t for t, _, _ in text) == "".join(f"<{t}>" for t in got)  # never the cold engine's text
        assert sup.generation_number == 2 and sup.torn_down == [1]
        assert sup.outcomes["continued"] == 1 and sup.restarts["worker_death"] == 1
        assert set(sup.recoveries[0]["phases_s"]) >= {"detect", "drain", "teardown", "placement_group", "engine_start"}
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0
        assert sup.state is State.STOPPED and sup.torn_down == [1, 2]

    run(scenario())


def test_engine_dead_seen_by_a_request_triggers_recovery(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        got = await collect(sup, [5], 20, lambda n: n == 4 and sup.engines[0].die())
        assert got == reference([5], 20)
        assert sup.restarts["engine_dead"] == 1
        owner.cancel()

    run(scenario())


def test_hang_is_detected_by_the_probe(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        got = await collect(sup, [9, 9], 25, lambda n: n == 5 and sup.engines[0].hung.set())
        assert got == reference([9, 9], 25)
        assert sup.restarts["hang"] == 1 and sup.recoveries[0]["reason"] == "hang"
        owner.cancel()

    run(scenario())


def test_an_engine_asleep_is_rebuilt_asleep_before_it_serves(tmp_path):
    """A recovery while the engines sleep (vLLM's sleep mode, GPU only) must not leave an awake
    engine on memory lent to another process: the new engine is put to sleep again at the same
    level, and woken as far as the old one was, before it is marked serving; paused, it is
    paused. A wake that reaches the others while the new engine is being held reaches it too.
    A level-2 sleep woken in part (new weights being loaded) is not replayed."""
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        seen = []
        FakeEngine.on_hold = lambda engine, call: seen.append(
            (call, getattr(sup.replicas[0].current, "engine", None) is engine, sup.state))

        async def recover(number):
            sup.engines[number - 1].die()
            sup.post(EngineFailed(number, "worker_death", "rank 0 killed"))
            await wait_for(lambda: sup.generation_number == number + 1 and sup.state is State.READY)
            return sup.engines[number]

        try:
            await sup.client.sleep(1)
            await sup.client.wake_up(["weights"])
            await sup.client.pause_generation(mode="keep")
            assert sup.engines[0].held == [("sleep", 1), ("wake_up", ["weights"]), ("pause_generation", {"mode": "keep"})]
            seen.clear()
            new = await recover(1)
            assert new.held == [("sleep", 1), ("wake_up", ["weights"]), ("pause_generation", {"mode": "keep"})]
            # each before the new engine served: not yet the replica's, the daemon still recovering
            assert [(c, current) for c, current, _ in seen] == [("sleep", False), ("wake_up", False), ("pause_generation", False)]
            assert all(state is State.RECOVERING for _, _, state in seen), seen

            # woken in full tag by tag and resumed: the next engine is built as it is
            await sup.client.wake_up(["kv_cache"])
            await sup.client.resume_generation()
            assert sup.client.asleep is None and sup.client.paused is None
            assert (await recover(2)).held is None

            # a wake that reaches the others while a new engine is being put to sleep reaches it too
            await sup.client.sleep(1)
            waking = []
            FakeEngine.on_hold = lambda engine, call: call == "sleep" and not waking and waking.append(
                asyncio.ensure_future(sup.client.wake_up()))
            new = await recover(3)
            # The wake came while the daemon was RECOVERING with no engine serving: the call answers
            # "unavailable" (a real engine's sleep yields, so it always did), yet the new engine,
            # held asleep, follows it before it serves (the owner holds it again: ``Recovery.rehold``).
            with pytest.raises(EngineUnavailable):
                await waking[0]
            assert new.held == [("sleep", 1), ("wake_up", None)] and not await new.is_sleeping()
            FakeEngine.on_hold = None

            # level 2 woken in part: the operator is loading new weights into the others
            await sup.client.sleep(2)
            await sup.client.wake_up(["weights"])
            assert (await recover(4)).held is None
        finally:
            FakeEngine.on_hold = None
        owner.cancel()

    run(scenario())


def test_new_requests_wait_in_bounded_queue_during_recovery(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path, admission_queue_size=1))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        sup.build_failures = 3  # keep it RECOVERING for a while
        sup.engines[0].die()
        sup.post(EngineFailed(1, "worker_death", "x"))
        await wait_for(lambda: sup.state is State.RECOVERING)
        waiting = asyncio.create_task(collect(sup, [4], 5))
        await wait_for(lambda: sup.client.waiting_new == 1)
        with pytest.raises(EngineUnavailable, match="admission queue is full"):
            await collect(sup, [4], 5)
        assert await waiting == reference([4], 5)  # served by the new engine
        assert sup.outcomes["rejected"] == 1 and sup.restarts["build_failed"] == 3
        owner.cancel()

    run(scenario())


def test_restart_intensity_exhausted_fails_in_flight_and_exits_3(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path, max_restarts=1))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        sup.engines[0].die()
        sup.post(EngineFailed(1, "worker_death", "first"))
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 2)

        def second(n):
            if n == 3:
                sup.engines[1].die()
                sup.post(EngineFailed(2, "worker_death", "second"))

        with pytest.raises(RequestFailed, match="retry"):
            await collect(sup, [1], 50, second)
        assert await owner == EXIT_FAILED
        assert sup.state is State.FAILED and "restart intensity" in sup.machine.reason

    run(scenario())


def test_fault_during_first_start_is_retried(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path), build_failures=2)
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        assert sup.generation_number == 3 and sup.restarts["build_failed"] == 2
        owner.cancel()

    run(scenario())


def test_death_of_the_generation_being_built_dooms_it(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        sup.engines[0].die()
        sup.post(EngineFailed(1, "worker_death", "first"))
        await wait_for(lambda: sup.owner.replicas[0].building == 2)
        sup.post(EngineFailed(2, "worker_death", "killed while starting"))
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 3)
        assert sup.torn_down == [1, 2]
        owner.cancel()

    run(scenario())


def test_failure_of_a_retired_generation_is_ignored(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        sup.engines[0].die()
        sup.post(EngineFailed(1, "worker_death", "rank 0 killed"))
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 2)
        # Generation 1's late reports (the engine-dead error of a slow request, a second
        # worker's death) arrive after generation 2 serves: they must not start a recovery.
        sup.post(EngineFailed(1, "engine_dead", "EngineDeadError from a late request"))
        sup.post(EngineFailed(1, "worker_death", "rank 1 died too"))
        await asyncio.sleep(0.3)
        assert sup.state is State.READY and sup.generation_number == 2
        assert sum(sup.restarts.values()) == 1 and sup.torn_down == [1]
        assert await collect(sup, [4, 5], 5) == reference([4, 5], 5)  # generation 2 still serves
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    run(scenario())


def test_lost_ray_cluster_is_a_failure_source(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path, max_restarts=0))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        sup.ray.cluster.reachable = lambda: False
        assert await owner == EXIT_FAILED  # no budget to rebuild: FAILED, exit 3
        assert sup.restarts["ray_lost"] == 1

    run(scenario())


def test_metrics_follow_the_lifecycle(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        got = await collect(sup, [3], 12, lambda n: n == 4 and (sup.engines[0].die(), sup.post(EngineFailed(1, "worker_death", "killed by `ray.kill`", ranks=(0,)))))
        assert got == reference([3], 12)
        m = sup.metrics
        assert m.state.labels("ready")._value.get() == 1 and m.state.labels("recovering")._value.get() == 0
        assert m.generation.labels("0")._value.get() == 2 and m.replica_up.labels("0")._value.get() == 1
        assert m.worker_deaths.labels("0", "killed")._value.get() == 1
        assert m.restarts.labels("0", "worker_death")._value.get() == 1
        assert m.requests.labels("continued")._value.get() == 1
        assert m.recovery_duration.labels("0")._sum.get() > 0 and m.ttft.sum > 0 and m.e2e.sum > 0
        assert m.worker_up.labels("0", "0")._value.get() == 1
        owner.cancel()

    run(scenario())


def test_a_requests_bookkeeping_ends_however_its_stream_ends(tmp_path):
    """In flight from its first read to its end, and counted by how it ended: read to the end
    (``n = 1`` and ``n = 2``), closed by a client that went away (no outcome), never read
    (never in flight: a generator's body that never ran has nothing to undo)."""
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        streams, m = sup.client.streams, sup.metrics
        ok = lambda: m.requests.labels("ok")._value.get()  # noqa: E731
        seen = []
        assert await collect(sup, [3], 6, lambda n: seen.append(streams.in_flight)) == reference([3], 6)
        assert set(seen) == {1} and streams.in_flight == 0 and streams.idle.is_set() and ok() == 1
        params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        outs = [out async for out in sup.client.generate({"prompt_token_ids": [5]}, params, "two")]
        assert outs[-1].finished and streams.in_flight == 0 and streams.idle.is_set() and ok() == 2
        gone = sup.client.generate({"prompt_token_ids": [7]}, SamplingParams(max_tokens=50, ignore_eos=True), "gone")
        await gone.__anext__()
        assert streams.in_flight == 1 and not streams.idle.is_set()
        await gone.aclose()  # the client went away
        assert streams.in_flight == 0 and streams.idle.is_set() and ok() == 2 and m.requests.labels("failed")._value.get() == 0
        sup.client.generate({"prompt_token_ids": [9]}, SamplingParams(max_tokens=5), "unread")  # never read
        assert streams.in_flight == 0 and streams.idle.is_set()
        assert m.e2e.count == 2 and m.ttft.count == 3
        owner.cancel()

    run(scenario())


def test_streams_stuck_in_a_dead_engines_abort_are_reaped(tmp_path):
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        old = sup.replicas[0].current

        def kill(n):
            if n == 3:
                sup.engines[0].errored = True  # dead, but its streams block instead of raising,
                sup.engines[0].output_processor = None  # and none can be woken: each reader's wait is cancelled
                sup.post(EngineFailed(1, "worker_death", "x"))

        results = await asyncio.gather(*(collect(sup, [i], 15, kill if i == 0 else None) for i in range(4)))
        assert results == [reference([i], 15) for i in range(4)]
        await wait_for(lambda: not old.lingering)  # nothing still holds the old engine
        await wait_for(lambda: old.engine is None and not old.readers)  # and it was let go, then collected
        owner.cancel()

    run(scenario())


def test_stop_string_across_the_seam_is_found_on_the_joined_text(tmp_path):
    """A stop string completes after the seam: the new engine never sees it (it only makes
    token ids); the supervisor finds it on the joined text, ends the stream there and
    aborts the engine's request. (A stop string that straddles the seam, with vLLM's
    hold-back of the text, is in ``test_seam_text``.)"""
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        want = reference([1, 2, 3], 30)
        stop = f"{want[8]}><{want[9]}"  # tokens 8 and 9 come from the second engine

        def kill_at_8(n):
            if n == 8:
                sup.engines[0].die()
                sup.post(EngineFailed(1, "worker_death", "rank 0 killed"))

        text = []
        got = await collect(sup, [1, 2, 3], 30, kill_at_8, text=text, stop=[stop])
        joined = "".join(f"<{t}>" for t in want[:10])
        assert got == want[:10]
        assert "".join(t for t, _, _ in text) == joined[: joined.index(stop)]
        assert text[-1][1:] == ("stop", stop)
        resumed = sup.engines[1].requests_seen[0]
        assert resumed.stop == [] and not resumed.detokenize
        assert sup.outcomes["continued"] == 1
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    run(scenario())


def test_a_worker_death_report_after_an_engine_dead_error_refines_the_cause(tmp_path):
    """The request saw ``EngineDeadError`` first; the executor's worker-death report of the
    same generation (detected before teardown) names the cause, ranks included. A report
    detected after the teardown began (our own kills) does not."""
    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        sup.engines[0].die()
        detected = time.monotonic()
        sup.post(EngineFailed(1, "engine_dead", "EngineDeadError"))
        sup.post(EngineFailed(1, "worker_death", "rank(s) [1] (w): killed by `ray.kill`", detected, ranks=(1,)))
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 2)
        rec = sup.recoveries[-1]
        assert (rec["reason"], rec["refined_from"]) == ("worker_death", "engine_dead") and "ray.kill" in rec["detail"]
        assert dict(sup.restarts) == {"worker_death": 1}
        sup.engines[1].die()
        sup.post(EngineFailed(2, "engine_dead", "EngineDeadError"))
        await wait_for(lambda: sup.generation_number == 3 and sup.state is State.READY)
        sup.post(EngineFailed(2, "worker_death", "killed by the teardown", time.monotonic()))  # too late
        await asyncio.sleep(0.2)
        assert sup.recoveries[-1]["reason"] == "engine_dead" and sup.generation_number == 3
        assert dict(sup.restarts) == {"worker_death": 1, "engine_dead": 1}
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    run(scenario())


def test_reload_edge_cases(tmp_path):
    """Supervisor-only changes apply at once without a rebuild; an invalid config keeps the
    running one; a reload while RECOVERING is ignored; an engine change rebuilds."""
    async def scenario():
        from config import ConfigError

        current = {"s": settings(tmp_path)}

        def reload_settings():
            value = current["s"]
            if isinstance(value, Exception):
                raise value
            return value, current.get("args", fake_args())

        sup = FakeSupervisor(settings(tmp_path), reload_settings=reload_settings)
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)

        current["s"] = settings(tmp_path, max_restarts=9, drain_timeout_s=3)
        sup.owner.dispatch(ReloadRequested())
        assert sup.cfg.max_restarts == 9 and sup.owner.replicas[0].intensity.max_restarts == 9 and sup.cfg.drain_timeout_s == 3
        assert sup.state is State.READY and sup.generation_number == 1 and not sup.restarts

        current["s"] = ConfigError(["config error: supervisor.max_restarts = -1: too small"])
        sup.owner.dispatch(ReloadRequested())
        assert "max_restarts" in sup.config_error and sup.cfg.max_restarts == 9 and sup.state is State.READY

        sup.build_failures = 2
        sup.engines[0].die()
        sup.post(EngineFailed(1, "worker_death", "x"))
        await wait_for(lambda: sup.state is State.RECOVERING)
        current["s"] = settings(tmp_path, max_restarts=1)
        sup.owner.dispatch(ReloadRequested())  # ignored: nothing to rebuild behind while recovering
        assert sup.cfg.max_restarts == 9
        await wait_for(lambda: sup.state is State.READY)

        current["s"] = settings(tmp_path, max_restarts=9)
        current["args"] = fake_args(max_model_len=512)  # vllm serve's --max-model-len
        before = sup.generation_number
        sup.owner.dispatch(ReloadRequested())
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == before + 1)
        assert sup.restarts["reload"] == 1 and sup.config_error == ""
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0

    run(scenario())



class FakeGcs:
    """A TCP listener standing in for the Ray head's GCS port: ``stop`` is the head lost,
    ``start`` again (same port) is the head back."""

    def __init__(self):
        self.port = 0
        self.server = None

    async def start(self):
        self.server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self):
        self.server.close()
        await self.server.wait_closed()

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"


def settings_with_ray(tmp_path, **ray):
    base = settings(tmp_path)
    return base.model_copy(update={"ray": base.ray.model_copy(update=ray)})


async def serving_beside_a_gcs(tmp_path, **ray):
    """A fake GCS listening, and a READY daemon watching it: (gcs, builder, sup, owner task)."""
    gcs = await FakeGcs().start()
    builder = FakeBuilder()
    builder.ray.gcs_address = gcs.address
    sup = FakeSupervisor(settings_with_ray(tmp_path, **ray), builder=builder)
    owner = asyncio.create_task(sup.run())
    await wait_for(lambda: sup.state is State.READY)
    return gcs, builder, sup, owner


def test_lost_gcs_parks_streams_and_the_rebuild_waits_until_it_listens_again(tmp_path):
    async def scenario():
        gcs, builder, sup, owner = await serving_beside_a_gcs(tmp_path, gcs_lost_after_s=0.3, reconnect_timeout_s=30)
        assert sup.cluster.status()["connected"] and builder.ray.connects == 1
        lost = asyncio.Event()

        def lose_at_7(n):
            if n == 7:
                lost.set()
                sup.engines[0].step_s = 0.05  # slow enough to be mid-stream when the loss is seen

        stream = asyncio.create_task(collect(sup, [1, 2, 3], 40, lose_at_7))
        await lost.wait()
        await gcs.stop()
        await wait_for(lambda: builder.ray.cluster_lost and sup.state is State.RECOVERING, 5)
        assert "ray cluster lost" in sup.machine.reason and not ready(sup)
        await asyncio.sleep(1.0)  # the GCS is still down: nothing is built, nothing reconnects
        assert sup.generation_number == 0 and builder.ray.connects == 1 and len(sup.engines) == 1
        assert sup.status()["ray"]["connected"] is False and sup.status()["ray"]["lost_for_s"] >= 1.0
        assert sup.metrics.ray_connected._value.get() == 0
        await gcs.start()  # the head is back on the same port
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 2, 10)
        assert await stream == reference([1, 2, 3], 40)  # the parked stream continued exactly
        assert sup.outcomes["continued"] == 1
        assert builder.ray.connects == 2 and not builder.ray.cluster_lost and sup.cluster.status()["connected"]
        assert sup.restarts["ray_lost"] == 1 and sup.recoveries[-1]["reason"] == "ray_lost"
        assert sup.metrics.ray_connected._value.get() == 1
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0
        await gcs.stop()

    run(scenario())


def test_a_worker_death_seen_after_the_gcs_went_quiet_counts_as_the_cluster_lost(tmp_path):
    """The head's processes die together: the executor reports its worker gone at once, the
    cluster watch only after gcs_lost_after_s. The recovery's cause is the cluster's loss."""
    async def scenario():
        gcs, builder, sup, owner = await serving_beside_a_gcs(tmp_path, gcs_lost_after_s=0.3, reconnect_timeout_s=30)
        teardown = builder.teardown
        builder.teardown = lambda gen: (time.sleep(1.0), teardown(gen))[1]  # the loss is seen mid-recovery
        await gcs.stop()
        sup.post(EngineFailed(1, "worker_death", "rank(s) [0] (vllm_Worker_x-g1): ActorUnavailableError: Socket closed"))
        await wait_for(lambda: builder.ray.cluster_lost, 5)
        await gcs.start()
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 2, 10)
        rec = sup.recoveries[-1]
        assert rec["reason"] == "ray_lost" and rec["refined_from"] == "worker_death", rec
        assert "ray cluster lost" in rec["detail"] and sup.restarts["ray_lost"] == 1 and sup.restarts["worker_death"] == 0
        # a worker death while the GCS answers stays one
        sup.post(EngineFailed(2, "worker_death", "rank(s) [0] (vllm_Worker_x-g2): killed"))
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 3, 10)
        assert sup.recoveries[-1]["reason"] == "worker_death" and "refined_from" not in sup.recoveries[-1]
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0
        await gcs.stop()

    run(scenario())


def test_gcs_not_back_before_the_deadline_exits_75(tmp_path):
    async def scenario():
        gcs, builder, sup, owner = await serving_beside_a_gcs(tmp_path, gcs_lost_after_s=0.2, reconnect_timeout_s=1.5)
        await gcs.stop()
        started = time.monotonic()
        assert await asyncio.wait_for(owner, 10) == 75
        assert 1.5 <= time.monotonic() - started < 6
        assert sup.state is State.FAILED and "not back within 1.5 s" in sup.machine.reason
        assert builder.ray.connects == 1 and sup.torn_down == [1]

    run(scenario())


def test_a_gcs_blip_shorter_than_gcs_lost_after_s_is_not_a_loss(tmp_path):
    async def scenario():
        gcs, builder, sup, owner = await serving_beside_a_gcs(tmp_path, gcs_lost_after_s=2.0)
        await gcs.stop()
        await asyncio.sleep(0.8)
        await gcs.start()
        await asyncio.sleep(2.0)
        assert sup.state is State.READY and sup.generation_number == 1 and not builder.ray.cluster_lost
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0
        await gcs.stop()

    run(scenario())


def test_a_ray_agent_that_dies_on_its_own_is_replaced(tmp_path):
    async def scenario():
        gcs, builder, sup, owner = await serving_beside_a_gcs(tmp_path, reconnect_timeout_s=10)  # the GCS keeps listening: only the agent died (OOM, crash)
        builder.ray.agent_up = False
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 2, 10)
        assert builder.ray.connects == 2 and sup.recoveries[-1]["reason"] == "ray_lost"
        assert "the Ray agent died" in sup.recoveries[-1]["detail"]
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0
        await gcs.stop()

    run(scenario())


def test_the_signal_handlers_it_replaced_are_put_back_at_exit(tmp_path):
    """SIGTERM, SIGINT and SIGHUP only enqueue while the daemon runs; at exit the handlers it
    replaced are back (an embedding program's, not SIG_DFL)."""
    def mine(signum, frame):
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, mine)
    try:
        async def scenario():
            sup = FakeSupervisor(settings(tmp_path))
            owner = asyncio.create_task(sup.run())
            await wait_for(lambda: sup.state is State.READY)
            assert signal.getsignal(signal.SIGHUP) is not mine  # the loop's, while it runs
            sup.post(SignalReceived(signal.SIGTERM))
            return await owner

        assert run(scenario()) == 0
        assert signal.getsignal(signal.SIGHUP) is mine
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


class Said:
    """Stands in for a module's structlog logger: records (level, event) of each line."""

    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def __getattr__(self, level):
        return lambda event, *args, **kw: self.lines.append((level, event))


@pytest.mark.parametrize("enable_log_requests", [False, True])
def test_a_line_per_request_at_info_only_with_vllms_enable_log_requests(tmp_path, monkeypatch, enable_log_requests):
    """As ``vllm serve`` logs requests: a plain request's two lines are info only with
    ``--enable-log-requests``, else debug (no cost at the default level); a request continued
    across a failure always ends with an info line, as its parking began with one."""
    import supervisor.stream as stream_mod

    said = Said()
    monkeypatch.setattr(stream_mod, "log", said)

    async def scenario():
        sup = FakeSupervisor(settings(tmp_path))
        sup.builder.engine_args.enable_log_requests = enable_log_requests
        owner = asyncio.create_task(sup.run())
        await wait_for(lambda: sup.state is State.READY)
        assert await collect(sup, [1, 2, 3], 5) == reference([1, 2, 3], 5)
        plain = list(said.lines)
        said.lines.clear()

        def kill_at_3(n):
            if n == 3:
                sup.engines[0].die()
                sup.post(EngineFailed(1, "worker_death", "rank 0 killed"))

        assert await collect(sup, [4, 5], 8, kill_at_3) == reference([4, 5], 8)
        sup.post(SignalReceived(signal.SIGTERM))
        assert await owner == 0
        return plain, said.lines

    plain, continued = run(scenario())
    level = "info" if enable_log_requests else "debug"
    assert plain == [(level, "request"), (level, "request done")]
    assert (level, "request") in continued and ("info", "request parked") in continued
    assert ("info", "request done") in continued
