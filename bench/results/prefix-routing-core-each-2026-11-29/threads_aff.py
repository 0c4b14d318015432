import os, sys, time, tempfile, pathlib, collections
from chaos.harness import Daemon
from chaos import inject
from tests.chaos.test_replicas import workers_by_replica

def aff(pid):
    out = collections.Counter()
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            a = sorted(os.sched_getaffinity(int(t)))
        except Exception:
            continue
        out[(name, tuple(a))] += 1
    return sorted(out.items())

mode = sys.argv[1]
config = {"engine": {"max_model_len": 1024, **({"executor": "mp"} if mode == "mp" else {})}}
with Daemon(pathlib.Path(tempfile.mkdtemp()), config, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, args=("--data-parallel-size", "2")).start() as d:
    d.wait_ready(); d.wait_replicas_serving()
    if mode == "mp":
        pids = inject.child_pids(set(inject.engine_core_pids(d.proc.pid)), b"VLLM::Worker")
    else:
        pids = [w["pid"] for w in workers_by_replica(d).values()]
    for pid in pids[:1]:
        print(mode, "worker", pid)
        for k, n in aff(pid):
            print("  ", n, k)
    for pid in inject.engine_core_pids(d.proc.pid)[:1]:
        print(mode, "engine core", pid, sorted(set(a for (_, a), _ in aff(pid))))
    print(mode, "daemon", sorted(set(a for (_, a), _ in aff(d.proc.pid))))
    d.stop()
