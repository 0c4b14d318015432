"""vLLM's older compiled-graph Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) under the
daemon, TP=2 on a real Ray head: a ``ray.kill`` of a worker mid-stream is reported as that
worker's death (rank, actor name, Ray's cause) by ``executor.ray_cgraph``'s watcher, every
stream continues exactly on the next generation, and nothing is left behind."""

from __future__ import annotations

import asyncio
import re

import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon
from chaos.load import PROMPTS, as_reference, run_with_fault
from tests.chaos.test_recovery import FAST_PROBES, assert_all_exact, assert_clean_generation, MAX_TOKENS, stop_leaves_nothing

pytestmark = pytest.mark.integration


# (engine layout, the workers' name suffixes, the rank killed): with PP the engine core drives
# the graph without blocking (vLLM returns a future per step), so a death surfaces later there.
LAYOUTS = {
    "tp2": ({"tensor_parallel_size": 2}, ["_TP0", "_TP1"], 1),
    "pp2": ({"pipeline_parallel_size": 2}, ["_PP0", "_PP1"], 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_graph_executor_kill_mid_stream(tmp_path, ray_head, layout):
    parallel, suffixes, rank = LAYOUTS[layout]
    config = {
        "engine": {**parallel, "max_model_len": 1024},
        "ray": {"address": ray_head.address},
        # Longer canary and hang timeouts than the other chaos tests': the graph's workers busy-poll
        # (each holds a core at ~100 %), which leaves this 2-core machine's engine core and
        # front little CPU; a 5 s canary was once called a hang in the reference run.
        "supervisor": {**FAST_PROBES, "hang_timeout_s": 30.0, "probe_timeout_s": 20.0, "max_restarts": 10},
    }
    env = {**OPERATOR_ENV, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"}
    with Daemon(tmp_path, config, env=env).start() as daemon:
        daemon.wait_ready()
        inject.prepare(ray_head.address)
        s = daemon.status()
        assert s["standby"]["mode"] == "none" or s["standby"]["state"] == "off", s["standby"]
        instance_id = s["replicas"][0]["instance_id"]
        names = sorted(w["name"] for w in inject.workers(ray_head.address, match=instance_id))
        assert [re.sub(r".*-g\d+", "", n) for n in names] == suffixes, names  # the generation in the name
        victim = f"{instance_id}{suffixes[rank]}"
        ref = as_reference(asyncio.run(run_with_fault(daemon.base_url, len(PROMPTS), MAX_TOKENS))[0])
        before = daemon.status()["generation"]  # the generation the kill hits
        if before != s["generation"]:  # the reference run was declared hung and recovered
            victim = victim.replace(f"-g{s['generation']}", f"-g{before}")
        records, info = asyncio.run(run_with_fault(daemon.base_url, 6, MAX_TOKENS,
                                                   lambda: inject.kill_worker(ray_head.address, match=victim)))
        assert_all_exact(records, ref)
        assert_clean_generation(daemon, ray_head, before)  # the graph's semaphores (sem.hdr/obj) swept too
        rec = daemon.status()["recoveries"][-1]
        # the executor's typed report (rank, actor, Ray's cause), even when a request saw the
        # engine core die first (then it refines that recovery's cause)
        assert rec["ok"] and rec["reason"] == "worker_death" and rec["cause"] == "killed", rec
        assert f"rank(s) [{rank}]" in rec["detail"] and suffixes[rank] in rec["detail"], rec
        log = daemon.log_path.read_text(errors="replace")
        assert re.search(rf"generation {before}: worker rank\(s\) \[{rank}\] died; supervisor notified", log), daemon.tail()
        detect_ms = (rec["detected_monotonic"] - info["monotonic"]) * 1000
        print(f"\ncompiled graph {layout}, kill {info['killed']}: detection {detect_ms:.0f} ms, recovery {rec['reason']}"
              f"{' (refined from ' + rec['refined_from'] + ')' if rec.get('refined_from') else ''}, "
              f"cause {rec.get('cause')}, phases {rec['phases_s']}")
        stop_leaves_nothing(daemon, ray_head)
