"""The daemon's HTTP answers to the supervisor's promises, over vLLM's own OpenAI front (the
real ``supervisor.http.Front`` on a real uvicorn, the demo model's config and tokenizer)
and fake engines (the lifecycle is ``test_supervisor_fake_engine``'s ``FakeSupervisor``):
queue full and admission timeout get 503 + ``Retry-After``; a parked stream whose recovery
outlasts ``recovery_timeout_s``, a request that cannot be continued exactly, and one
interrupted more than ``continuation_limit`` times end with a clear error; SIGTERM drains
running streams while new requests get 503."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import time
from types import SimpleNamespace

import httpx
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

from chaos.harness import data_dir, free_port
from supervisor.events import EngineFailed, SignalReceived
from supervisor.generation import Generation
from supervisor.http import Front
from supervisor.states import State
from tests.unit.test_supervisor_fake_engine import FakeBuilder, FakeSupervisor, settings, wait_for

SAFE = list(range(300, 340))  # demo-model token ids the fake engine emits


@functools.cache
def demo_front():
    """vLLM's serve Namespace for the demo model (parsed by the daemon's own CLI) and its
    engine config; no engine is started."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from supervisor.builder import EngineBuilder
    from supervisor.cli import parse_serve

    st, args = parse_serve(["--data-dir", str(data_dir())])
    EngineBuilder(st, args, "t", "", ray=None).prepare_model()
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config()


class FakeEngine:
    """Speaks ``AsyncLLM``'s language to vLLM's front: real ``RequestOutput``s, delta or
    final-only, ``n = 1`` (the supervisor splits ``n > 1``); deterministic over the whole
    context and the seed."""

    def __init__(self, vllm_config, tokenizer, step_s=0.005):
        self.vllm_config, self.model_config, self.tokenizer = vllm_config, vllm_config.model_config, tokenizer
        self.step_s = step_s
        self.errored = False
        self.dead = asyncio.Event()

    def die(self):
        self.errored = True
        self.dead.set()

    def shutdown(self, timeout=None):
        pass

    def check_admission(self, n=1, request_id=None):
        pass

    async def check_health(self):
        if self.errored:
            raise EngineDeadError()

    async def get_supported_tasks(self):
        return ("generate",)

    async def do_log_stats(self):
        pass

    async def abort(self, request_id):
        pass

    async def generate(self, prompt, params, request_id, **kwargs):
        ctx = list(prompt["prompt_token_ids"])
        n0, delta = len(ctx), params.output_kind == RequestOutputKind.DELTA
        for i in range(params.max_tokens):
            await asyncio.sleep(self.step_s)
            if (params.extra_args or {}).get("supervisor_test_poison"):
                self.die()  # a query of death: this engine dies when the request enters it
            if self.dead.is_set():
                raise EngineDeadError()
            ctx.append(SAFE[(sum(ctx) * 31 + len(ctx) + (params.seed or 0)) % len(SAFE)])
            done = "length" if i == params.max_tokens - 1 else None
            if not delta and not done:
                continue
            ids = ctx[-1:] if delta else ctx[n0:]
            text = self.tokenizer.decode(ids) if params.detokenize else ""
            yield RequestOutput(request_id, prompt.get("prompt"), prompt["prompt_token_ids"], None,
                                [CompletionOutput(0, text, ids, None, None, finish_reason=done)], done is not None)


class HttpBuilder(FakeBuilder):
    """The fake builder with the demo model's real front (renderer, tokenizer)."""

    build_s = 0.0

    def __init__(self, vllm_config):
        super().__init__()
        from executor.engine import frontend_for

        self.vllm_config = vllm_config
        self.renderer, self.input_processor = frontend_for(vllm_config)

    def build(self, number, standby=None, replica=0, start_workers=None):
        if number > 1:
            time.sleep(self.build_s)
        engine = FakeEngine(self.vllm_config, self.renderer.get_tokenizer())
        self.engines.append(engine)
        return Generation(number, f"fake-g{number}", engine, set(), 0.0, replica=replica, epoch=getattr(self, "config_epoch", 0))

    def front(self, engine):
        return self.renderer, self.input_processor


async def started(tmp_path, build_s=0.0, **supervisor):
    args, vllm_config = demo_front()
    args = SimpleNamespace(**vars(args))
    args.port = free_port()
    builder = HttpBuilder(vllm_config)
    builder.build_s = build_s
    builder.engine_args = args
    supervisor.setdefault("standby", "none")  # the standby's logic: test_standby_fake.py
    sup = FakeSupervisor(settings(tmp_path, **supervisor), builder=builder, detokenizer=None)
    owner = asyncio.create_task(sup.run())
    await wait_for(lambda: sup.state is State.READY)
    front = Front(sup, args)
    front.bind()
    serving = asyncio.create_task(front.serve())
    await wait_for(lambda: front.app is not None and front.server.started)
    sup._test_server = (front, serving)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=30)
    return sup, owner, client


async def finish(sup, owner, client):
    await client.aclose()
    front, serving = sup._test_server
    await front.stop()
    await serving
    if not owner.done():
        owner.cancel()


def kill(sup):
    gen = sup.replicas[0].current
    gen.engine.die()
    sup.post(EngineFailed(gen.number, "worker_death", "rank 0 killed"))


async def read_stream(client, body, on_tokens=None):
    """(text, error event or None) of a streamed completion; ``on_tokens(n)`` after each chunk."""
    text, error, n = "", None, 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            for choice in event["choices"]:
                text += choice["text"]
                n += 1
                if on_tokens:
                    on_tokens(n)
    return text, error


def run(coro):
    """``asyncio.run``, except that a task still running after the scenario (and its own
    teardown) fails the test naming it, instead of hanging the run in asyncio's final cancel:
    in the daemon such a task would hang its exit."""

    async def scenario_then_leftovers():
        try:
            return await coro
        finally:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            pending = (await asyncio.wait(rest, timeout=10))[1] if rest else set()
            if pending:
                for t in pending:
                    t.print_stack()
                raise AssertionError(f"tasks that ignore cancellation: {[t.get_coro() for t in pending]}")

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(scenario_then_leftovers())
    finally:
        loop.close()


def test_admission_queue_full_and_admission_timeout_get_503_with_retry_after(tmp_path):
    async def scenario():
        sup, owner, client = await started(tmp_path, build_s=3.0, admission_queue_size=1, admission_timeout_s=0.5)
        kill(sup)
        await wait_for(lambda: sup.state is State.RECOVERING)
        waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
        await wait_for(lambda: sup.client.waiting_new == 1)
        full = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
        assert full.status_code == 503 and "admission queue is full" in full.json()["error"]["message"]
        assert int(full.headers["retry-after"]) > 0 and full.headers["connection"] == "close"  # no keep-alive race
        timed_out = await waiting
        assert timed_out.status_code == 503 and "no engine within 0.5 s" in timed_out.json()["error"]["message"]
        assert int(timed_out.headers["retry-after"]) > 0
        assert sup.outcomes["rejected"] == 2
        await finish(sup, owner, client)

    run(scenario())


def test_parked_stream_past_recovery_timeout_ends_with_an_error_event(tmp_path):
    async def scenario():
        sup, owner, client = await started(tmp_path, build_s=3.0, recovery_timeout_s=0.5)
        text, error = await read_stream(client, {"prompt": "abc", "max_tokens": 40, "temperature": 0},
                                        on_tokens=lambda n: n == 5 and kill(sup))
        assert error and "no engine within 0.5 s" in error["message"] and error["code"] == 503
        assert text  # what was delivered before the fault stays delivered
        assert sup.outcomes["failed"] == 1
        await finish(sup, owner, client)

    run(scenario())


def test_a_request_that_cannot_be_continued_ends_with_a_clear_retriable_error(tmp_path):
    """On engines whose workers do not carry a request's past (the ``mp`` executor's), a
    streamed request with a presence penalty cut mid-stream ends with a clear retriable error.
    The same request not streamed has delivered nothing when cut: it simply runs again."""
    from supervisor.continuation import Engines

    async def scenario():
        sup, owner, client = await started(tmp_path)
        sup.client.engines = Engines(history="the mp executor's workers do not carry a continued request's past")
        body = {"prompt": "abc", "max_tokens": 40, "presence_penalty": 0.5}
        text, error = await read_stream(client, body, on_tokens=lambda n: n == 5 and kill(sup))
        assert error and "cannot be continued exactly" in error["message"] and "penalties: the mp executor" in error["message"]
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 2)
        # Not streamed, nothing was delivered when the engine died: it runs again, exactly.
        reference = (await client.post("/v1/completions", json={**body, "temperature": 0})).json()
        whole = asyncio.create_task(client.post("/v1/completions", json={**body, "temperature": 0}))
        await wait_for(lambda: sup.replicas[0].current.readers)  # running on generation 2
        await asyncio.sleep(0.05)
        kill(sup)
        r = await whole
        assert r.status_code == 200 and sup.generation_number == 3, r.text
        assert r.json()["choices"] == reference["choices"] and r.json()["usage"] == reference["usage"]
        await finish(sup, owner, client)

    run(scenario())


def test_each_choice_of_n_is_continued_on_its_own(tmp_path):
    """``n = 3`` with a seed, streamed and not, cut mid-stream: every choice reads what a
    fault-free run reads (each its own seed + index), the request is counted once."""
    async def choices(client, body, on_chunk=None):
        if not body.get("stream"):
            r = (await client.post("/v1/completions", json=body)).json()
            return {c["index"]: (c["text"], c["finish_reason"]) for c in r["choices"]}, r["usage"]
        text, finish, usage, chunks = {}, {}, None, 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for c in event["choices"]:
                        text[c["index"]] = text.get(c["index"], "") + c["text"]
                        finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
                        chunks += 1
                        if on_chunk:
                            on_chunk(chunks)
                    usage = event.get("usage") or usage
        return {i: (text[i], finish[i]) for i in text}, usage

    async def scenario():
        sup, owner, client = await started(tmp_path)
        for stream in (True, False):
            body = {"prompt": "abc", "max_tokens": 30, "n": 3, "seed": 5, "temperature": 0.8, "stream": stream,
                    "stream_options": {"include_usage": True} if stream else None}
            reference = await choices(client, body)
            assert len({t for t, _ in reference[0].values()}) == 3  # each choice its own seed
            generation = sup.generation_number
            if stream:
                got = await choices(client, body, on_chunk=lambda n: n == 20 and kill(sup))
            else:
                whole = asyncio.create_task(choices(client, body))
                await wait_for(lambda: len(sup.replicas[0].current.readers) == 3)
                await asyncio.sleep(0.05)
                kill(sup)
                got = await whole
            assert got == reference and sup.generation_number == generation + 1
        assert sup.outcomes["continued"] == 2 and sup.outcomes["failed"] == 0, sup.outcomes
        await finish(sup, owner, client)

    run(scenario())


def test_a_query_of_death_is_quarantined_and_the_innocents_beside_it_finish_exactly(tmp_path):
    """Four established streams and a request whose every engine dies when it enters: the
    poison ends with a 422 error event after two engine failures, the innocents read their
    fault-free text (neither failure counts against them: continuation_limit 1 would fail them
    otherwise), the resend is refused at admission, the crash loop spends one restart."""
    from supervisor.suspects import ESTABLISHED

    async def scenario():
        sup, owner, client = await started(tmp_path, continuation_limit=1)
        bodies = [{"prompt": f"innocent {i}", "max_tokens": 200, "temperature": 0} for i in range(4)]
        reference = [await read_stream(client, b) for b in bodies]
        innocents = [asyncio.create_task(read_stream(client, b)) for b in bodies]
        await wait_for(lambda: len(sup.replicas[0].current.choices) == 4 and all(
            c.suspect.outputs_here >= ESTABLISHED for c in sup.replicas[0].current.choices.values()))
        generation = sup.generation_number
        poison = {"prompt": "poison", "max_tokens": 20, "vllm_xargs": {"supervisor_test_poison": 1}}
        text, error = await read_stream(client, poison)
        assert error and error["code"] == 422 and "request quarantined" in error["message"], error
        assert await asyncio.gather(*innocents) == reference
        await wait_for(lambda: sup.state is State.READY)
        assert sup.generation_number == generation + 2  # two engine failures, no more
        assert sup.outcomes["quarantined"] == 1 and sup.outcomes["failed"] == 0, sup.outcomes
        assert sup.owner.replicas[0].intensity.recent == 1  # the crash loop counts once
        again = await client.post("/v1/completions", json=poison)
        assert again.status_code == 422 and "request refused" in again.json()["error"]["message"], again.text
        assert sup.generation_number == generation + 2 and sup.outcomes["quarantined"] == 2
        await finish(sup, owner, client)

    run(scenario())


def test_more_interruptions_than_continuation_limit_end_the_stream(tmp_path):
    async def scenario():
        sup, owner, client = await started(tmp_path, continuation_limit=1)
        kills = {5: 1, 15: 2}

        def on_tokens(n):
            if n in kills and sup.generation_number == kills[n]:
                kill(sup)

        text, error = await read_stream(client, {"prompt": "abc", "max_tokens": 60, "temperature": 0}, on_tokens)
        assert error and "interrupted 2 times" in error["message"] and "limit 1" in error["message"]
        assert sup.outcomes["failed"] == 1
        await wait_for(lambda: sup.restarts["worker_death"] == 2)
        await finish(sup, owner, client)

    run(scenario())


def test_sigterm_drains_running_streams_and_rejects_new_requests(tmp_path):
    async def scenario():
        sup, owner, client = await started(tmp_path, drain_timeout_s=30)
        running = asyncio.create_task(read_stream(client, {"prompt": "abc", "max_tokens": 200, "temperature": 0}))
        await wait_for(lambda: sup.client.in_flight == 1)
        sup.post(SignalReceived(signal.SIGTERM))
        await wait_for(lambda: sup.state is State.STOPPING)
        late = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert late.status_code == 503 and "stopping" in late.json()["error"]["message"]
        assert int(late.headers["retry-after"]) > 0 and late.headers["connection"] == "close"
        assert sup.state is State.STOPPING and not running.done()  # still draining
        text, error = await running
        assert error is None and len(sup.engines) == 1  # finished in full on the old engine
        assert await owner == 0 and sup.state is State.STOPPED
        await finish(sup, owner, client)

    run(scenario())
