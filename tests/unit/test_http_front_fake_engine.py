"""The daemon's HTTP answers to the supervisor's promises, over the real FastAPI app and a
fake engine (the lifecycle is ``test_supervisor_fake_engine``'s ``FakeSupervisor``): queue full
and admission timeout get 503 + ``Retry-After``; a parked stream whose recovery outlasts
``recovery_timeout_s``, a request that cannot be continued exactly, and one interrupted more
than ``continuation_limit`` times end with a clear error; SIGTERM drains running streams
while new requests get 503."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import uvicorn

from chaos.harness import free_port
from supervisor.daemon import EngineFailed, SignalReceived
from supervisor.server import UvicornServer, build_app
from supervisor.states import State
from tests.unit.test_supervisor_fake_engine import FakeSupervisor, settings, wait_for


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [3 + ord(c) % 500 for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


class SlowBuildSupervisor(FakeSupervisor):
    """Engine builds after the first take ``build_s``: a recovery that lasts."""

    build_s = 0.0

    def _build_generation(self, number):
        if number > 1:
            time.sleep(self.build_s)
        return super()._build_generation(number)


async def started(tmp_path, build_s=0.0, **supervisor):
    sup = SlowBuildSupervisor(settings(tmp_path, **supervisor))
    sup.build_s = build_s
    owner = asyncio.create_task(sup.run())
    await wait_for(lambda: sup.state is State.READY)
    sup.tokenizer = FakeTokenizer()
    # A real uvicorn on loopback: httpx's ASGI transport would buffer whole streams.
    port = free_port()
    server = UvicornServer(uvicorn.Config(build_app(sup), host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started)
    sup._test_server = (server, serving)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
    return sup, owner, client


async def finish(sup, owner, client):
    await client.aclose()
    server, serving = sup._test_server
    server.should_exit = True
    await serving
    if not owner.done():
        owner.cancel()


def kill(sup):
    gen = sup.current
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
    return asyncio.run(coro)


def test_admission_queue_full_and_admission_timeout_get_503_with_retry_after(tmp_path):
    async def scenario():
        sup, owner, client = await started(tmp_path, build_s=3.0, admission_queue_size=1, admission_timeout_s=0.5)
        kill(sup)
        await wait_for(lambda: sup.state is State.RECOVERING)
        waiting = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
        await wait_for(lambda: sup.waiting_new == 1)
        full = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
        assert full.status_code == 503 and "admission queue is full" in full.json()["error"]["message"]
        assert int(full.headers["retry-after"]) > 0
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
    async def scenario():
        sup, owner, client = await started(tmp_path)
        body = {"prompt": "abc", "max_tokens": 40, "presence_penalty": 0.5}
        text, error = await read_stream(client, body, on_tokens=lambda n: n == 5 and kill(sup))
        assert error and "cannot be continued exactly" in error["message"] and "penalties" in error["message"]
        await wait_for(lambda: sup.state is State.READY and sup.generation_number == 2)
        whole = asyncio.create_task(client.post("/v1/completions", json=body))
        await wait_for(lambda: sup.current.pumps)  # running on generation 2
        await asyncio.sleep(0.05)
        kill(sup)
        r = await whole
        assert r.status_code == 503 and "cannot be continued exactly" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) > 0
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
        await wait_for(lambda: sup.in_flight == 1)
        sup.post(SignalReceived(signal.SIGTERM))
        await wait_for(lambda: sup.state is State.STOPPING)
        late = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert late.status_code == 503 and "stopping" in late.json()["error"]["message"]
        assert int(late.headers["retry-after"]) > 0
        assert sup.state is State.STOPPING and not running.done()  # still draining
        text, error = await running
        assert error is None and text.count("<") == 200  # finished in full on the old engine
        assert await owner == 0 and sup.state is State.STOPPED
        await finish(sup, owner, client)

    run(scenario())
