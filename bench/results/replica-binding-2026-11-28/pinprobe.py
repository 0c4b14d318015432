"""Daemon DP=2 (prefix routing, its own local Ray) with its model workers left alone or pinned
to core 0 (taskset, all threads), alternating; the prefix-routing workload each time."""
import os, subprocess, sys, time, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main")
from bench.prefix_routing import measure, workload_parser
from chaos.harness import Daemon
from executor import procfs
args = workload_parser().parse_args(["--out", "/tmp/t/pin"])  # the bench's own workload
def workers():
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            t = (procfs.read(int(p), "cmdline") or b"").split(b"\0")[0]
            if t.startswith((b"ray::SupervisedRayWorkerProc", b"ray::RayWorkerProc", b"ray::StandbyRayWorkerProc.run")):
                out.append((int(p), t[:60].decode()))
    return out
for r in range(int(sys.argv[1])):
    for pin in [m == "taskset" for m in sys.argv[2].split(",")]:
        work = Path(tempfile.mkdtemp(prefix="pin-"))
        config = {"engine": {"max_model_len": 1024}, "ray": {"address": ""}, "supervisor": {"routing": "prefix"}}
        flags = ("--data-parallel-size", "2", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log")
        with Daemon(work, config, args=flags, own_session=True).start() as d:
            d.wait_ready(); d.wait_replicas_serving()
            ws = workers()
            env = {}
            for pid, t in ws:
                env[pid] = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                if pin:
                    subprocess.run(["taskset", "-a", "-p", "-c", "0", str(pid)], check=True, capture_output=True)
            omp = {pid: [e.decode() for e in v if e.startswith((b"OMP_", b"KMP_", b"GOMP"))] for pid, v in env.items()}
            nthreads = {pid: len(os.listdir(f"/proc/{pid}/task")) for pid, _ in ws}
            row = measure(d.base_url, args)
            aff = {}
            for pid, _ in ws:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    try:
                        st = open(f"/proc/{pid}/task/{tid}/stat").read()
                        name = st[st.index("(")+1:st.rindex(")")]; f = st[st.rindex(")")+2:].split()
                        ticks = int(f[11]) + int(f[12])
                        if ticks > 20:
                            aff.setdefault(pid, []).append(f"{name}:{ticks}t:{sorted(os.sched_getaffinity(int(tid)))}")
                    except (FileNotFoundError, ProcessLookupError):
                        pass
            print(f"round {r+1} pinned={pin}: took {row['took_s']} s, hit {100*row['hit_rate']:.1f} %, TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f}; workers {ws} threads {nthreads} omp {omp}; busy threads {aff}", flush=True)
            code, _ = d.stop()
