"""A bundle claim is released only after its worker's process is gone (issue 41, finding 2).

On a GPU host an adopted standby worker holds no GPU in Ray's accounting; its bundle claim
(``executor.claim``) does. Ray marks a killed actor DEAD before its process has exited: a
worker that does not answer the kill (hung in a kernel, stopped) lives about 5 s more, until
its raylet's SIGKILL, with its device memory. A claim released in that window lets the next
generation's worker be placed on a GPU that is still full. Shown here on a real Ray cluster
with a stopped stand-in worker: Ray calls it DEAD at once, its process stays, and the claim
goes only after the process (``RayCluster.kill_instance_actors``, the teardown's path; the
executor's own shutdown calls the same ``release_claims``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = """
import json, os, signal, sys, threading, time
import ray
from ray._private import state
from executor.claim import BundleClaim
from executor.cluster import RayCluster
from executor.procfs import running

ray.init(address=sys.argv[1], namespace="claim-release-test", log_to_driver=False)

@ray.remote(num_cpus=0)
class Worker:
    def pid(self):
        return os.getpid()

instance = "claimtest-g1"
worker = Worker.options(name=f"vllm_Worker_{instance}_TP0").remote()
claim = ray.remote(BundleClaim).options(name=f"vllm_Claim_{instance}_TP0", namespace="claim-release-test",
                                        lifetime="detached", num_cpus=0).remote()
worker_pid = ray.get(worker.pid.remote())
claim_pid = ray.get(claim.__ray_call__.remote(lambda self: os.getpid()))
os.kill(worker_pid, signal.SIGSTOP)  # a worker that does not answer the kill

t0 = time.monotonic()
seen = {}
def watch():
    while len(seen) < 3 and time.monotonic() - t0 < 60:
        now = time.monotonic() - t0
        if "worker_dead_in_gcs" not in seen and state.actors(actor_id=worker._actor_id.hex())["State"] == "DEAD":
            seen["worker_dead_in_gcs"] = now
        for key, pid in (("worker_gone", worker_pid), ("claim_gone", claim_pid)):
            if key not in seen and not running(pid):
                seen[key] = now
        time.sleep(0.01)
watcher = threading.Thread(target=watch)
watcher.start()
killed = RayCluster.kill_instance_actors(instance)
returned = time.monotonic() - t0
watcher.join()
print(json.dumps({"killed": sorted(killed), "returned_s": returned, **seen}))
"""


def test_a_claim_outlives_its_killed_worker_process(ray_head):
    out = subprocess.run([sys.executable, "-c", SCENARIO, ray_head.address], env=dict(ray_head.env, PYTHONPATH=str(ROOT)),
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n{seen}")
    assert seen["killed"] == ["vllm_Claim_claimtest-g1_TP0", "vllm_Worker_claimtest-g1_TP0"], seen
    # the hazard is real: Ray called the worker DEAD seconds before its process exited
    assert seen["worker_gone"] - seen["worker_dead_in_gcs"] >= 2.0, seen
    # and the claim was released only after the process had gone
    assert seen["claim_gone"] >= seen["worker_gone"], seen
