"""vLLM's older compiled-graph Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) under the
daemon, TP=2 and PP=2 on a real Ray head: the graph is compiled in the build (a fault-free run
causes no recovery); a ``ray.kill`` of a worker mid-stream is reported as that worker's death
(rank, actor name, Ray's cause) by the failed step itself (with PP: its future's ``result()``),
every stream continues exactly on the next generation; a kill while idle is reported by the
GCS actor-table poller; nothing is left behind.

The daemon runs with ``VLLM_SUPERVISOR_TEST_HOOKS=1`` (``executor.testhooks``): while serving,
the poller and the shutdown's late check do not report, so only the step's report can name the
cause; while idle, a canary's failed step waits for the poller's report."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon
from chaos.load import PROMPTS, as_reference, run_with_fault
from supervisor import testhooks
from tests.chaos.test_recovery import FAST_PROBES, assert_all_exact, assert_clean_generation, MAX_TOKENS, stop_leaves_nothing

pytestmark = [pytest.mark.integration, pytest.mark.extended]


# (engine layout, the workers' name suffixes, the rank killed): with PP the engine core drives
# the graph without blocking (vLLM returns a future per step), so a death surfaces later there.
LAYOUTS = {
    "tp2": ({"tensor_parallel_size": 2}, ["_TP0", "_TP1"], 1),
    "pp2": ({"pipeline_parallel_size": 2}, ["_PP0", "_PP1"], 1),
}
IDLE_KILL = {"tp2"}  # the layouts that also get a kill while idle (the GCS poller's case)


def assert_compiled_in_build(daemon: Daemon, generation: int) -> None:
    """The executor compiled generation ``generation``'s graph during its build (docs/executors.md,
    "Executors beyond Ray V2"): the compile's log line comes before the daemon's "engine up"."""
    lines = daemon.log_path.read_text(errors="replace").splitlines()
    compiled = [i for i, line in enumerate(lines) if f"generation {generation}: compiled graph built in" in line]
    up = [i for i, line in enumerate(lines) if '"event": "engine up"' in line and f'"engine_generation": {generation},' in line]
    assert compiled and up and compiled[0] < up[0], (
        f"generation {generation}: graph not compiled in the build (compile log lines {compiled}, engine up {up})\n"
        + daemon.tail())


def wait_canary_after(daemon: Daemon, wall: float, timeout_s: float = 60) -> None:
    """Until a canary (the idle probe) succeeded after ``wall``: the engine's last step was a canary."""
    deadline = time.monotonic() + timeout_s
    while (daemon.status()["probe"]["last_success_unix"] or 0) <= wall:
        assert time.monotonic() < deadline, f"no canary succeeded within {timeout_s} s: {daemon.status()}"
        time.sleep(0.1)


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
    env = {**OPERATOR_ENV, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0", testhooks.ENV: "1"}
    with Daemon(tmp_path, config, env=env).start() as daemon:
        daemon.wait_ready()
        inject.prepare(ray_head.address)
        s = daemon.status()
        assert s["standby"]["mode"] == "none" or s["standby"]["state"] == "off", s["standby"]
        instance_id = s["replicas"][0]["instance_id"]
        names = sorted(w["name"] for w in inject.workers(ray_head.address, match=instance_id))
        assert [re.sub(r".*-g\d+", "", n) for n in names] == suffixes, names  # the generation in the name
        victim = f"{instance_id}{suffixes[rank]}"
        before = s["generation"]  # the generation the kill hits
        assert_compiled_in_build(daemon, before)
        ref = as_reference(asyncio.run(run_with_fault(daemon.base_url, len(PROMPTS), MAX_TOKENS))[0])
        # the fault-free run caused no recovery (a compile on the first step once made it a "hang")
        s = daemon.status()
        assert s["generation"] == before and not s["recoveries"] and not s["restarts"], (s, daemon.tail())
        records, info = asyncio.run(run_with_fault(daemon.base_url, 6, MAX_TOKENS,
                                                   lambda: inject.kill_worker(ray_head.address, match=victim)))
        assert_all_exact(records, ref)
        after = assert_clean_generation(daemon, ray_head, before)["generation"]  # the graph's semaphores (sem.hdr/obj) swept too
        assert_compiled_in_build(daemon, after)
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

        # A kill while idle (no request; the last step was a canary): only the GCS actor-table
        # poller sees it. Once, with TP: the poller is the same code for every layout, and each
        # such kill costs a rebuild (~30 s here).
        if layout in IDLE_KILL:
            # Reported as that worker's death, by the poller.
            wait_canary_after(daemon, time.time())
            s = daemon.status()
            assert s["generation"] == after and s["in_flight"] == 0 and s["state"] == "ready", s
            idle_victim = f"{s['replicas'][0]['instance_id']}{suffixes[rank]}"
            info = inject.kill_worker(ray_head.address, match=idle_victim)
            assert info["killed"].endswith(idle_victim), info
            daemon.wait_generation(after + 1)
            rec = daemon.status()["recoveries"][-1]
            assert rec["ok"] and rec["from_generation"] == after and rec["reason"] == "worker_death" and rec["cause"] == "killed", rec
            assert f"rank(s) [{rank}]" in rec["detail"] and idle_victim in rec["detail"], rec
            log = daemon.log_path.read_text(errors="replace")
            assert re.search(rf"generation {after}: the GCS actor-table poller found worker rank\(s\) \[{rank}\] dead", log), (
                "the idle kill was not reported by the poller\n" + daemon.tail())
            # the next generation serves (its graph's semaphores are mapped once a step ran), clean
            assert_all_exact(asyncio.run(run_with_fault(daemon.base_url, 2, MAX_TOKENS))[0], ref)
            assert_clean_generation(daemon, ray_head, after)
            print(f"idle kill {info['killed']}: detection {(rec['detected_monotonic'] - info['monotonic']) * 1000:.0f} ms "
                  f"(the GCS poller), phases {rec['phases_s']}")
        stop_leaves_nothing(daemon, ray_head)
