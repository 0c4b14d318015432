"""TP=2 (two worker actors) on an existing Ray cluster, like a real deployment: serve,
stop with SIGTERM, and check the cluster holds no placement group or actor of ours."""

from __future__ import annotations

import signal

import openai
import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon

pytestmark = [pytest.mark.integration, pytest.mark.extended]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, ray_head):
    config = {"engine": {"tensor_parallel_size": 2}, "ray": {"address": ray_head.address}}
    with Daemon(tmp_path_factory.mktemp("tp2"), config, env=OPERATOR_ENV).start() as d:
        d.wait_ready()
        yield d


def test_two_worker_actors_named_with_the_generation(daemon, ray_head):
    seen = ray_head.tool("inspect")
    workers = sorted(a["name"] for a in inject.select(seen["actors"]))  # the serving engine's
    assert len(workers) == 2, seen
    assert all("-g1_TP" in name for name in workers), workers
    # anything else is the warm standby, already named for generation 2
    standby = sorted(a["name"] for a in seen["actors"] if a["name"] not in workers)
    assert all("-g2_TP" in name for name in standby) and len(standby) in (0, 2), seen
    assert [pg["state"] for pg in seen["placement_groups"]] == ["CREATED"]


def test_serves_greedy_completions_deterministically(daemon):
    client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="unused", max_retries=0)

    def run():
        return client.completions.create(model="demo-tiny-llama", prompt="Two workers", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})

    first, second = run(), run()
    assert first.usage.completion_tokens == 20
    assert first.choices[0].text == second.choices[0].text
    stream = client.chat.completions.create(model="demo-tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) >= 1


def test_sigterm_leaves_no_placement_group_actor_process_or_shm(daemon, ray_head):
    code, took = daemon.stop(signal.SIGTERM)
    assert code == 0, daemon.tail()
    assert took < 60
    daemon.assert_nothing_left()
    seen = ray_head.tool("inspect")
    assert seen == {"placement_groups": [], "actors": []}
