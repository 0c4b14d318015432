"""What the client reads survives recoveries: 16 concurrent requests through the ``openai``
SDK — completions and chat, streamed and not, chats with a system prompt, some with stop
strings — each compared with a fault-free run of the same request on its text, finish
reason, usage and (completions) token ids.

Each round kills a worker twice under the same requests: first with every request held by
the daemon's test hook right after a token that ends inside a multi-byte UTF-8 character (so
every seam is mid-character), then again shortly after the next engine is up, while the
continued requests run (a second seam at an arbitrary token of the same requests).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from chaos import inject
from chaos.harness import Daemon
from chaos.load import as_reference, compare, run_with_fault, specs
from executor.shm import mapped_segments
from chaos.harness import shm_segments

pytestmark = pytest.mark.integration

N = 16
MAX_TOKENS = 300
HOLD_AFTER = 8  # tokens before the hook looks for a mid-character token
STOPPED = (1, 6, 10, 15)  # requests that get a stop string (completions and chat, streamed and not)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, ray_head):
    config = {
        "engine": {"tensor_parallel_size": 1, "max_model_len": 1024},
        "ray": {"address": ray_head.address},
        "supervisor": {"max_restarts": 20, "probe_interval_s": 1.0, "restart_backoff_initial_s": 0.2,
                       "continuation_limit": 2},
    }
    with Daemon(tmp_path_factory.mktemp("client-text"), config, env={"VLLM_SUPERVISOR_TEST_HOOKS": "1"}).start() as d:
        d.wait_ready()
        inject.prepare(ray_head.address)  # so a fault lands mid-stream, not after a first vLLM import
        yield d


@pytest.fixture(scope="module")
def requests_and_reference(daemon):
    """The 16 requests, with stop strings cut from a first fault-free run's text (so they
    occur), and the fault-free reference of exactly those requests."""
    plain = asyncio.run(run_with_fault(daemon.base_url, N, MAX_TOKENS, records=specs(N, MAX_TOKENS, mixed=True)))[0]
    as_reference(plain)
    for i in STOPPED:
        text = plain[i].text
        at = len(text) // 2
        plain[i].stop = [text[at:at + 3]]
    requests = [r.__class__(r.index, r.prompt, r.max_tokens, kind=r.kind, stream=r.stream, stop=r.stop,
                            system=r.system) for r in plain]
    records = asyncio.run(run_with_fault(daemon.base_url, N, MAX_TOKENS, records=requests))[0]
    assert sum(r.finish_reason == "stop" for r in records) == len(STOPPED), [r.finish_reason for r in records]
    return requests, as_reference(records)


def fresh(requests, hold: int | None):
    return [r.__class__(r.index, r.prompt, r.max_tokens, kind=r.kind, stream=r.stream, stop=r.stop, system=r.system,
                        hold=hold) for r in requests]


@pytest.mark.parametrize("round_", [1, 2])
def test_two_kills_per_round_client_text_equals_a_fault_free_run(daemon, ray_head, requests_and_reference, round_):
    requests, ref = requests_and_reference
    before = daemon.status()
    held_at_kill: list[int] = []

    def all_held() -> bool:
        s = daemon.status()
        return s["test_held"] > 0 and s["test_held"] == s["in_flight"]

    def two_kills() -> dict:
        held_at_kill.append(daemon.status()["test_held"])
        first = inject.kill_worker(ray_head.address, rank=0)
        s = daemon.wait_generation(before["generation"] + 1, timeout_s=240)
        time.sleep(0.5)  # the continued requests are running on the new engine
        in_flight = daemon.status()["in_flight"]
        second = inject.kill_worker(ray_head.address, rank=0)
        return {"first": first, "second": second, "in_flight_at_second": in_flight, "generation": s["generation"]}

    records, info = asyncio.run(run_with_fault(daemon.base_url, N, MAX_TOKENS, two_kills,
                                               records=fresh(requests, HOLD_AFTER), ready_for_fault=all_held))
    summary = compare(records, ref)
    assert summary["failed"] == 0, [(r.index, r.status, r.error) for r in records if r.outcome != "ok"]
    assert summary["mismatched"] == 0, summary
    assert not any("SECRET" in r.text for r in records)  # the system prompt never reaches the answer

    after = daemon.wait_generation(before["generation"] + 2, timeout_s=240)
    new = after["recoveries"][len(before["recoveries"]):]
    assert [r["reason"] for r in new][:2] == ["worker_death", "worker_death"], new
    assert held_at_kill[0] >= N - len(STOPPED), held_at_kill  # nearly every request seamed mid-character
    assert info["in_flight_at_second"] > 0, info  # the second kill hit running requests too
    continued = after["requests"].get("continued", 0) - before["requests"].get("continued", 0)
    assert continued >= held_at_kill[0], (continued, held_at_kill)
    # nothing of the killed generations is left
    seen = inject.inspect(ray_head.address)
    names = [a["name"] for a in seen["actors"]]
    assert names and all(n.endswith(f"-g{after['generation']}") for n in names), names
    assert len(seen["placement_groups"]) == 1, seen
    leaked = (shm_segments() - daemon.shm_before) - mapped_segments()
    assert not {n for n in leaked if not n.startswith("sem.")}, leaked
    print(f"\nround {round_}: {N} requests, held mid-character at the first kill: {held_at_kill[0]}, "
          f"in flight at the second: {info['in_flight_at_second']}, continued: {continued}, text mismatches: 0")


def test_continuation_limit_and_non_continuable_requests_through_real_kills(daemon, ray_head):
    """Three kills under the same requests with ``continuation_limit = 2``: a streamed request
    with a presence penalty cannot be continued exactly and ends at the first kill with a
    clear retriable error event; the same request not streamed has sent nothing, so it runs
    again after each kill; every request is interrupted a third time and ends with an error
    (an error event when streamed, 503 when not)."""
    long = 900
    requests = specs(4, long, mixed=False, hold=HOLD_AFTER)
    requests[1].stream = requests[3].stream = False
    penalized = {2, 3}
    for i in penalized:
        requests[i].extra = {"presence_penalty": 0.5}
    before = daemon.status()["generation"]

    def all_held() -> bool:  # the non-streamed penalized request runs as asked: it is never held
        s = daemon.status()
        return s["test_held"] == 3

    def three_kills() -> dict:
        for k in range(3):
            if k:
                daemon.wait_generation(before + k, timeout_s=240)
                time.sleep(0.3)
            inject.kill_worker(ray_head.address, rank=0)
        return {}

    records, _ = asyncio.run(run_with_fault(daemon.base_url, 4, long, three_kills, records=requests,
                                            ready_for_fault=all_held))
    daemon.wait_generation(before + 3, timeout_s=240)
    for r in records:
        assert r.outcome == "error", (r.index, r.finish_reason, len(r.token_ids))
        if r.index in penalized and r.stream:
            assert "cannot be continued exactly" in r.error and "penalties" in r.error, r.error
        else:
            assert "interrupted 3 times" in r.error and "limit 2" in r.error, r.error
        if not r.stream:
            assert r.status == 503, r
        else:
            assert r.text  # what was delivered before the error stays delivered


def test_sigterm_drains_running_streams_and_rejects_new_ones(daemon, ray_head, requests_and_reference):
    """SIGTERM with streams running: they finish in full (the drain), a request arriving
    while STOPPING gets 503 + Retry-After, the daemon exits 0 and leaves nothing."""
    requests, ref = requests_and_reference
    streamed = [r for r in fresh(requests, None) if r.stream and not r.stop][:4]
    late: dict = {}

    def sigterm_then_new_request() -> dict:
        daemon.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while daemon.status()["state"] != "stopping":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = daemon.post("/v1/completions", json={"prompt": "late", "max_tokens": 4})
        late.update(status=r.status_code, retry_after=r.headers.get("retry-after"), body=r.json())
        return {}

    records, _ = asyncio.run(run_with_fault(daemon.base_url, len(streamed), MAX_TOKENS, sigterm_then_new_request,
                                            records=streamed))
    summary = compare(records, ref)
    assert summary["failed"] == 0 and summary["mismatched"] == 0, summary
    assert late["status"] == 503 and int(late["retry_after"]) > 0 and "stopping" in late["body"]["error"]["message"]
    assert daemon.proc.wait(120) == 0, daemon.tail()
    daemon.assert_nothing_left()
    assert inject.inspect(ray_head.address) == {"placement_groups": [], "actors": []}
