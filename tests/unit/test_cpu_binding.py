"""``executor.cpu_binding``: each replica's lone CPU worker bound as ``vllm serve
--data-parallel-size N`` binds each rank's, a ``|`` list sliced per replica, and a standby made
for one replica's cores bound again, at adoption, to another's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from executor import cpu_binding
from executor.cpu_binding import BIND_VAR, bound_list_error, cores_of, rebinding


def gomp(cores: str, threads: int = 1) -> dict[str, str]:
    """vLLM's variables for a list of cores, with no OpenMP runtime preloaded."""
    return {"OMP_NUM_THREADS": str(threads), "OMP_PLACES": "{" + cores + "}", "OMP_PROC_BIND": "true"}


def test_the_cores_are_read_from_whichever_runtime_vllm_set():
    assert cores_of(gomp("2,3")) == [2, 3]
    assert cores_of({"GOMP_CPU_AFFINITY": "4 5 6"}) == [4, 5, 6]
    assert cores_of({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[7,8]", "KMP_BLOCKTIME": "5"}) == [7, 8]
    assert cores_of({"OMP_NUM_THREADS": "2"}) == []


def test_a_standby_is_rebound_only_where_the_cores_alone_differ():
    env = {"RAY_worker_niceness": "0"}
    assert rebinding({**env, **gomp("0")}, {**env, **gomp("0")}) == {}
    assert rebinding({**env, **gomp("0")}, {**env, **gomp("1")}) == gomp("1")  # another replica's core
    assert rebinding(gomp("0,1"), gomp("2,3", 2)) is None  # another thread count: the pool is made
    assert rebinding(gomp("0"), gomp("1,2")) is None
    assert rebinding(gomp("0"), {"GOMP_CPU_AFFINITY": "1", "OMP_NUM_THREADS": "1"}) is None  # another runtime
    assert rebinding(gomp("0"), {}) is None  # bound against Ray's pool: decided at the process start
    assert rebinding({}, gomp("1")) is None
    assert rebinding({**gomp("0"), "OMP_PROC_BIND": "false"}, gomp("1")) is None


def test_the_adoption_guard_lets_only_the_cores_differ():
    from executor.adoption import binding_change, option_mismatch

    def options(env):
        return {"name": "w", "runtime_env": {"env_vars": {"TORCH_COMPILE_DISABLE": "1", **env}}}

    assert option_mismatch(options(gomp("0")), options(gomp("1"))) == []
    assert binding_change(options(gomp("0")), options(gomp("1"))) == gomp("1")
    assert binding_change(options(gomp("0")), options(gomp("0"))) == {}
    assert option_mismatch(options(gomp("0")), options(gomp("1,2", 2))) == [
        "runtime_env.env_vars.OMP_NUM_THREADS", "runtime_env.env_vars.OMP_PLACES"]
    assert binding_change(options(gomp("0")), options(gomp("1,2", 2))) == {}
    assert option_mismatch(options({**gomp("0"), "X": "1"}), options(gomp("1"))) == ["runtime_env.env_vars.X"]


def test_a_list_per_replica_must_have_an_entry_for_every_worker_of_every_replica(monkeypatch):
    """Checked before Ray starts (``parse_serve`` exits 78 with it); a GPU host ignores the variable."""
    monkeypatch.setattr(cpu_binding.current_platform, "is_cpu", lambda: True)
    assert bound_list_error(2, 1, "0|1") == ""
    assert bound_list_error(2, 1, "0-3") == ""  # one list: every replica's worker bound to it
    assert bound_list_error(1, 1, "0|1|2") == ""  # one engine: vLLM's own check
    assert bound_list_error(2, 2, "0|1|2|3") == ""
    for replicas, world, value in ((2, 1, "0|1|2"), (3, 1, "0|1"), (2, 2, "0|1"), (2, 1, "0|")):
        assert BIND_VAR in bound_list_error(replicas, world, value)
    monkeypatch.setattr(cpu_binding.current_platform, "is_cpu", lambda: False)
    assert bound_list_error(2, 1, "0|1|2") == ""


def test_the_cli_refuses_a_list_that_does_not_fit_the_replicas(monkeypatch):
    from supervisor.cli import ServeArgsError, parse_serve

    monkeypatch.setattr(cpu_binding.current_platform, "is_cpu", lambda: True)
    monkeypatch.setenv(BIND_VAR, "0|1|1")
    with pytest.raises(ServeArgsError, match=f"{BIND_VAR}='0\\|1\\|1' lists 3 sets of cores; --data-parallel-size 2 needs 2"):
        parse_serve(["--data-parallel-size", "2"])
    monkeypatch.setenv(BIND_VAR, "0|1")
    settings, _ = parse_serve(["--data-parallel-size", "2"])
    assert settings.supervisor.replicas == 2


def test_each_replica_takes_its_slice_of_the_list(monkeypatch):
    def config(replica, replicas=2, world=1):
        return SimpleNamespace(parallel_config=SimpleNamespace(world_size=world),
                               additional_config={"vllm_supervisor": {"replica": replica, "replicas": replicas}})

    monkeypatch.setenv(BIND_VAR, "0-1|2-3|4-5|6-7")
    assert [cpu_binding.replica_entries(config(r, 4)) for r in range(4)] == ["0-1", "2-3", "4-5", "6-7"]
    assert [cpu_binding.replica_entries(config(r, 2, 2)) for r in range(2)] == ["0-1|2-3", "4-5|6-7"]
    assert cpu_binding.replica_entries(config(0, 1)) is None  # one engine
    with cpu_binding.replica_slice(config(1, 4)):
        assert os.environ[BIND_VAR] == "2-3"
    assert os.environ[BIND_VAR] == "0-1|2-3|4-5|6-7"
    monkeypatch.setenv(BIND_VAR, "0-3")
    assert cpu_binding.replica_entries(config(1)) is None


REBIND = """
import json, os, threading
from executor.cpu_binding import rebind
ready, done = threading.Event(), threading.Event()
tids = {}
def pinned():
    os.sched_setaffinity(0, {0})
    tids["pinned"] = threading.get_native_id(); ready.set(); done.wait()
def loose():
    tids["loose"] = threading.get_native_id(); done.wait()
threads = [threading.Thread(target=pinned), threading.Thread(target=loose)]
[t.start() for t in threads]; ready.wait()
while "loose" not in tids: pass
moved = rebind({"OMP_NUM_THREADS": "1", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"},
               {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"})
out = {name: sorted(os.sched_getaffinity(tid)) for name, tid in tids.items()}
out.update(moved=moved, places=os.environ["OMP_PLACES"], main=sorted(os.sched_getaffinity(0)))
done.set(); [t.join() for t in threads]
print(json.dumps(out))
"""


def test_rebind_moves_the_threads_bound_to_the_old_cores_and_no_other():
    """In a process of its own: a thread bound to core 0 moves to core 1; the unbound ones stay."""
    assert len(os.sched_getaffinity(0)) >= 2, "needs two cores (the CI machine has two)"
    out = subprocess.run([sys.executable, "-c", REBIND], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    everything = sorted(os.sched_getaffinity(0))
    assert got == {"pinned": [1], "loose": everything, "moved": 1, "places": "{1}", "main": everything}, got


POOL = """
import json, os
import torch
from executor.cpu_binding import rebind
old = {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}
moved = rebind(old, {**old, "OMP_PLACES": "{1}"})
torch.ones(1 << 22).mul_(2).sum()  # a parallel region after the move
print(json.dumps({"moved": moved, "threads": torch.get_num_threads(),
                  "cores": sorted({c for t in os.listdir("/proc/self/task") for c in os.sched_getaffinity(int(t))})}))
"""


def test_rebind_moves_the_openmp_pool_made_before_and_after_it():
    """torch's OpenMP runtime started on core 0 (as a standby made for replica 0 starts): after
    ``rebind`` to core 1 every thread of the process is on core 1, the pool's too. Without the
    pool made before the move, its thread would start on the place the runtime read at start
    (core 0: seen with the warm-up taken out)."""
    assert len(os.sched_getaffinity(0)) >= 2, "needs two cores (the CI machine has two)"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}
    out = subprocess.run([sys.executable, "-c", POOL], capture_output=True, text=True, timeout=120, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"moved": 2, "threads": 2, "cores": [1]}, got
