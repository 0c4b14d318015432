"""The API under hostile input, on the real daemon (demo model, Ray, vLLM): the tests run on
``tests/integration/test_serving.py``'s daemon (the defaults a user gets, with a warm standby), which
imports them, so they run first there and cost no daemon start of their own.

* Hand-written hostile requests: huge, negative and non-finite numbers, wrong types, invalid
  UTF-8, empty and oversized bodies, unknown models, prompts longer than the context, a
  client that sends half a body and vanishes, one that sends it slowly: each gets a 4xx
  with a message.
* Afterwards the daemon still serves the fault-free reference text, on the generation it
  started with (no recovery, no restart: a hostile request never costs an engine), and its
  log holds no unhandled exception (no traceback, no error-level line naming an exception).
* ``schemathesis`` (``fuzz/test_schemathesis.py``, run by ``make chaos``, not by ``make test``:
  each run finds new vLLM crashes, see docs/security.md, "Tested") drives the daemon's own OpenAPI
  schema for ``FUZZ_S`` seconds on a daemon of its own; it uses ``still_serving_exactly`` from here.

Not collected by itself (no ``test_`` prefix): ``pytest tests/integration/test_serving.py -k hostile``
runs these alone.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from chaos.harness import Daemon
from chaos.load import as_reference, compare, run_with_fault

MODEL = "demo-tiny-llama"
STREAMS, TOKENS = 4, 64


@pytest.fixture(scope="module")
def hostile_ref(daemon: Daemon) -> dict:
    """The fault-free reference read before any hostile request, and the status they must not
    change (its generation, restarts and recoveries), kept on the daemon."""
    ref = as_reference(asyncio.run(run_with_fault(daemon.base_url, STREAMS, TOKENS))[0])
    daemon.before_hostile = daemon.status()
    return ref


def still_serving_exactly(daemon: Daemon, ref: dict) -> None:
    assert daemon.get("/readyz").status_code == 200, daemon.tail()
    records, _ = asyncio.run(run_with_fault(daemon.base_url, STREAMS, TOKENS))
    summary = compare(records, ref)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, summary


def _post(d: Daemon, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(d.base_url + path, content=content, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})})


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text
    err = body.get("error") if isinstance(body, dict) else None
    return (err.get("message") if isinstance(err, dict) else None) or str(body.get("detail") or err or "")


LONG_PROMPT = "word " * 2000  # the demo model's context is 256 tokens
HOSTILE: list[tuple[str, str, bytes]] = [
    ("max_tokens negative", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}).encode()),
    ("max_tokens huge", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10**30}).encode()),
    ("max_tokens past the context", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 100000}).encode()),
    ("temperature NaN", "/v1/completions", b'{"model": "demo-tiny-llama", "prompt": "hi", "temperature": NaN}'),
    ("top_p Infinity", "/v1/completions", b'{"model": "demo-tiny-llama", "prompt": "hi", "top_p": Infinity}'),
    ("temperature -1", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode()),
    ("n zero", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 0}).encode()),
    ("n a billion", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 10**9, "max_tokens": 1}).encode()),
    ("logprobs negative", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "logprobs": -5}).encode()),
    ("prompt a number", "/v1/completions", json.dumps({"model": MODEL, "prompt": 123}).encode()),
    ("prompt an object", "/v1/completions", json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode()),
    ("prompt token ids out of vocabulary", "/v1/completions", json.dumps({"model": MODEL, "prompt": [10**9, -4]}).encode()),
    ("prompt longer than the context", "/v1/completions", json.dumps({"model": MODEL, "prompt": LONG_PROMPT}).encode()),
    ("chat prompt longer than the context", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}).encode()),
    ("messages a string", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode()),
    ("messages of numbers", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": [1, 2]}).encode()),
    ("unknown model", "/v1/completions", json.dumps({"model": "gpt-17", "prompt": "hi"}).encode()),
    ("invalid UTF-8", "/v1/completions", b'{"model": "demo-tiny-llama", "prompt": "\xff\xfe\xfd"}'),
    ("lone surrogate", "/v1/completions", b'{"model": "demo-tiny-llama", "prompt": "\\udc80"}'),
    ("empty body", "/v1/completions", b""),
    ("null body", "/v1/completions", b"null"),
    ("array body", "/v1/chat/completions", b"[]"),
    ("truncated JSON", "/v1/completions", b'{"model": "demo-tiny-llama", "prompt": "hi'),
    ("oversized body", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * (1 << 20)}).encode()),  # > 1 MiB
    ("deeply nested JSON", "/v1/completions", b'{"model": "demo-tiny-llama", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"),
    ("responses: assistant message without content", "/v1/responses", json.dumps(
        {"model": MODEL, "input": [{"type": "message", "role": "assistant", "content": []}]}).encode()),
    ("responses: assistant message starting with a refusal", "/v1/responses", json.dumps(
        {"model": MODEL, "input": [{"type": "message", "role": "assistant", "id": "m", "status": "completed",
                                    "content": [{"type": "refusal", "refusal": "no"}]}]}).encode()),
    ("tokenize an object", "/tokenize", json.dumps({"model": MODEL, "prompt": {"x": 1}}).encode()),
    ("detokenize out-of-vocabulary ids", "/detokenize", json.dumps({"model": MODEL, "tokens": [10**12]}).encode()),
]


@pytest.mark.parametrize("name,path,body", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_gets_a_4xx_with_a_message(daemon, hostile_ref, name, path, body):
    r = _post(daemon, path, body)
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:500])
    assert (r.status_code == 413) == (name == "oversized body"), (name, r.status_code)  # reached vLLM, not the size limit
    assert _message(r), (name, r.text[:500])


def test_a_client_that_vanishes_or_dawdles_costs_nothing(daemon, hostile_ref):
    d, ref = daemon, hostile_ref
    body = json.dumps({"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(20):  # half a body, then gone
        with socket.create_connection(("127.0.0.1", d.port)) as s:
            s.sendall(head + body[: len(body) // 2])
    with socket.create_connection(("127.0.0.1", d.port), timeout=60) as s:  # a slow one: 1 byte per 50 ms
        s.sendall(head)
        for i in range(0, len(body), 8):
            s.sendall(body[i:i + 8])
            time.sleep(0.05)
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert d.status()["in_flight"] == 0
    still_serving_exactly(d, ref)


UNHANDLED = re.compile(r"traceback \(most recent call last\)|exception in asgi application|unhandled exception"
                       r"|task exception was never retrieved|exception in callback", re.IGNORECASE)
ERROR_LEVEL = re.compile(r'"level": "(error|critical)"|\b(ERROR|CRITICAL)\b')


def unhandled_exceptions(text: str) -> list[str]:
    """The log's lines that show an exception nobody handled: a traceback, uvicorn's and
    asyncio's reports, and any error-level line (ours in JSON, vLLM's and Ray's in text) that
    names an exception."""
    return [line[:300] for line in text.splitlines()
            if UNHANDLED.search(line) or (ERROR_LEVEL.search(line) and "exception" in line.lower())]


def test_no_recovery_and_no_unhandled_exception_after_the_hostile_requests(daemon, hostile_ref):
    """Runs after every hostile request above: none of them cost a recovery or a restart (the
    same generation serves, no restart counted, none recorded), and the daemon's log (the
    daemon's own lines, vLLM's and Ray's) holds no unhandled exception."""
    d, ref = daemon, hostile_ref
    before, now = d.before_hostile, d.status()
    assert now["restarts"] == before["restarts"] == {}, f"a hostile request cost a restart: {now['restarts']}"
    assert now["recoveries"] == before["recoveries"] == [], f"a hostile request cost a recovery: {now['recoveries']}"
    assert (now["state"], now["generation"]) == ("ready", before["generation"]), (now["state"], now["reason"], now["generation"])
    assert [r["generation"] for r in now["replicas"]] == [r["generation"] for r in before["replicas"]], now["replicas"]
    still_serving_exactly(d, ref)
    bad = unhandled_exceptions(d.log_path.read_text(errors="replace"))
    assert not bad, "unhandled exception in the daemon's log:\n" + "\n".join(bad[:20])
