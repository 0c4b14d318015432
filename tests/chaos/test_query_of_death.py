"""A query of death (``supervisor.suspects``): a request whose every engine dies when it enters
the batch, beside long innocent streams, on the default daemon. The poison is marked
``vllm_xargs={"supervisor_test_poison": 1}``: with the test hooks on, a worker dies by SIGKILL
at the step that request enters (``executor.testhooks.poisoned``), on every engine it reaches.

Before ``supervisor.suspects`` the same scenario failed every innocent stream with the poison
("interrupted 4 times") and spent four restarts of the budget per poison.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon
from chaos.load import as_reference, compare, run_with_fault, specs
from tests.chaos.test_recovery import FAST_PROBES, stop_leaves_nothing

pytestmark = pytest.mark.integration

INNOCENTS = 16
# A real query of death in vLLM 0.32 on CPU, found while building this: a seeded sampled request
# whose prompt is prefilled in chunks (longer than --max-num-batched-tokens). vLLM discards the
# sample of a partial prefill and rewinds the request's generator with ``set_offset``, which a CPU
# generator does not have: "RuntimeError: CPU Generator does not use offset" in the worker, the
# engine core dies (``vllm serve`` exits).
BATCHED_TOKENS = 64
REAL_POISON = {"model": "demo-tiny-llama", "prompt": " ".join(["hello world"] * 60), "max_tokens": 20,
               "temperature": 0.8}
LONG = 1000  # tokens (the model's limit is 1024): the innocents outlive the poison's recoveries


def poison(base_url: str, stream: bool, seed: int = 0, real: bool = False) -> httpx.Response:
    """A poisoned completion, as a client sends it; the response as it reads it. ``real``: an
    input that crashes vLLM 0.32's CPU engine by itself (``REAL_POISON``) instead of the test hook's mark."""
    body = {"model": "demo-tiny-llama", "prompt": f"Poison number {seed}", "max_tokens": 50, "temperature": 0,
            "stream": stream, "vllm_xargs": {"supervisor_test_poison": 1}}
    if real:
        body = {**REAL_POISON, "seed": seed, "stream": stream}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        r = client.post("/v1/completions", json=body)
        r.read()
        return r


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, ray_head):
    config = {"engine": {"tensor_parallel_size": 1, "max_model_len": 1024}, "ray": {"address": ray_head.address},
              "supervisor": {**FAST_PROBES}}  # the default restart budget: 5 in 600 s
    with Daemon(tmp_path_factory.mktemp("qod"), config, env={**OPERATOR_ENV, "VLLM_SUPERVISOR_TEST_HOOKS": "1"},
                args=("--max-num-batched-tokens", str(BATCHED_TOKENS))).start() as d:
        d.wait_ready()
        inject.prepare(ray_head.address)
        yield d
        stop_leaves_nothing(d, ray_head)


def fault_free(daemon) -> dict:
    """The innocents' fault-free run on ``daemon``: the reference ``innocents_beside`` compares with."""
    records = specs(INNOCENTS, LONG, mixed=True)
    return as_reference(asyncio.run(run_with_fault(daemon.base_url, INNOCENTS, LONG, records=records))[0])


@pytest.fixture(scope="module")
def reference(daemon) -> dict:
    """Run once: the same requests on the same engine settings read the same in every test here
    (greedy)."""
    return fault_free(daemon)


def innocents_beside(daemon, reference, poisons, first: int = 0, real: bool = False) -> tuple[list, dict, list[httpx.Response]]:
    """The innocents (``reference``: their fault-free run) with ``poisons`` (stream flags) sent
    one after the other once every innocent streams; (records, reference, poison responses)."""
    answers: list[httpx.Response] = []

    def send_poisons() -> None:
        for i, stream in enumerate(poisons):
            answers.append(poison(daemon.base_url, stream, seed=first + i, real=real))

    sender = threading.Thread(target=send_poisons, name="poisons")

    def first_crash() -> dict:
        """Send the poisons (in the background: the innocents may finish before their answers)
        and return once the first engine failure is seen, mid-stream."""
        def replicas() -> list:
            return [(r["state"], r["generation"]) for r in daemon.status()["replicas"]]

        before = replicas()
        sender.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sender.is_alive() and replicas() == before:
            time.sleep(0.05)
        return {}

    records = specs(INNOCENTS, LONG, mixed=True)

    def innocents_established() -> bool:  # the streamed ones read 8 chunks; the others run as long
        return all(len(r.chunk_times) >= 8 for r in records if r.stream)

    got, _ = asyncio.run(run_with_fault(daemon.base_url, INNOCENTS, LONG, first_crash, records=records,
                                        ready_for_fault=innocents_established))
    sender.join(600)
    assert not sender.is_alive() and len(answers) == len(poisons), answers
    return got, reference, answers


def assert_quarantined(r: httpx.Response, stream: bool) -> None:
    if stream:  # the error event before [DONE]
        assert r.status_code == 200 and "request quarantined" in r.text and '"code":422' in r.text.replace(" ", ""), r.text[-600:]
    else:
        assert r.status_code == 422 and "request quarantined" in r.json()["error"]["message"], r.text


def test_one_poison_costs_two_engines_and_no_innocent(daemon, reference, ray_head):
    before = daemon.status()
    got, reference, (answer,) = innocents_beside(daemon, reference, [True])
    summary = compare(got, reference)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, sorted({r.error for r in got if r.error}))  # 16/16 exact
    assert_quarantined(answer, stream=True)
    after = daemon.wait_generation(before["generation"] + 2, timeout_s=240)
    assert after["generation"] == before["generation"] + 2, after  # at most two engine failures
    assert after["requests"].get("quarantined", 0) == before["requests"].get("quarantined", 0) + 1
    assert after["replicas"][0]["restarts_in_window"] == before["replicas"][0]["restarts_in_window"] + 1, after
    # the same input again: refused at admission, no engine fails
    again = poison(daemon.base_url, stream=False)
    assert again.status_code == 422 and "request refused" in again.json()["error"]["message"], again.text
    time.sleep(2)
    s = daemon.status()
    assert s["state"] == "ready" and s["generation"] == after["generation"], s
    metrics = httpx.get(daemon.base_url + "/metrics").text
    assert "vllm_supervisor_requests_quarantined_total 1.0" in metrics
    print(f"\none poison beside {INNOCENTS} innocents: {INNOCENTS}/{INNOCENTS} exact, poison quarantined after 2 engine "
          f"failures, its resend refused; restarts in window {after['replicas'][0]['restarts_in_window']}")


def test_three_poisons_in_the_restart_window_never_fail_the_daemon(daemon, reference, ray_head):
    """Six engine failures within the budget's window (5 restarts in 600 s): each poison's crash
    loop counts once, so the daemon stays up; without that it would go FAILED on the sixth."""
    before = daemon.status()
    got, reference, answers = innocents_beside(daemon, reference, [True, False, True], first=10)  # inputs not yet seen
    summary = compare(got, reference)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, sorted({r.error for r in got if r.error}))
    for r, stream in zip(answers, [True, False, True]):
        assert_quarantined(r, stream)
    after = daemon.wait_generation(before["generation"] + 6, timeout_s=300)
    assert after["state"] == "ready" and after["replicas"][0]["restarts_in_window"] <= 5, after
    print(f"\nthree poisons: 6 engine failures, daemon {after['state']}, restarts in window "
          f"{after['replicas'][0]['restarts_in_window']}, {INNOCENTS}/{INNOCENTS} innocents exact")


def test_a_real_input_that_crashes_vllms_cpu_engine_is_quarantined(daemon, reference, ray_head):
    """``REAL_POISON``: no test hook, an input that crashes vLLM 0.32's CPU engine core by itself
    (a seeded request prefilled in chunks). Quarantined after two engine failures, the innocents
    beside it exact, the resend refused."""
    before = daemon.status()
    got, reference, (answer,) = innocents_beside(daemon, reference, [False], first=30, real=True)
    summary = compare(got, reference)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, (summary, sorted({r.error for r in got if r.error}))
    assert_quarantined(answer, stream=False)
    after = daemon.wait_generation(before["generation"] + 2, timeout_s=240)
    assert after["generation"] == before["generation"] + 2 and after["state"] == "ready", after
    assert "CPU Generator does not use offset" in daemon.log_path.read_text(errors="replace")  # vLLM's own failure
    again = poison(daemon.base_url, stream=True, seed=30, real=True)
    assert again.status_code == 200 and "request refused" in again.text, again.text
    print(f"\na real crashing input (seeded, chunked prefill): quarantined after 2 engine failures, "
          f"{INNOCENTS}/{INNOCENTS} innocents exact, the resend refused")
