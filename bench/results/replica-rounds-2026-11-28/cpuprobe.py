"""Daemon DP=2 (prefix, own local Ray) against vllm serve DP=2, alternating; the prefix-routing
workload each time; CPU per process (all processes on the machine) and per busy thread over the load."""
import os, sys, time, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main")
from bench.prefix_routing import measure, workload_parser
from bench.common import VllmServe
from chaos.harness import Daemon
args = workload_parser().parse_args(["--out", "/tmp/t/cpu2"])  # the bench's own workload
def snap():
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                st = open(f"/proc/{p}/task/{tid}/stat").read()
                name = st[st.index("(")+1:st.rindex(")")]; f = st[st.rindex(")")+2:].split()
                try: aff = ",".join(map(str, sorted(os.sched_getaffinity(int(tid)))))
                except OSError: aff = "?"
                try: run_ns, wait_ns, slices = map(int, open(f"/proc/{p}/task/{tid}/schedstat").read().split())
                except (OSError, ValueError): wait_ns, slices = 0, 0
                out[(int(p), int(tid))] = (name, int(f[11]) + int(f[12]), f"{f[36]}/aff{aff}/ni{f[16]}", wait_ns, slices)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
    return out
def title(pid):
    try: return open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode()[:45]
    except Exception: return "?"
def report(kind, row, a, b):
    procs, threads = {}, []
    for k, (name, t, cpu, wait, slices) in b.items():
        before = a.get(k, (name, 0, 0, 0, 0))
        d = t - before[1]
        if d <= 0: continue
        procs[k[0]] = procs.get(k[0], 0) + d
        if d >= 30: threads.append((d, k[0], name, f"{cpu}/runq-wait{(wait - before[3]) / 1e9:.1f}s/slices{slices - before[4]}"))
    total = sum(procs.values())
    print(f"== {kind}: took {row['took_s']} s, hit {100*row['hit_rate']:.1f} %, TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f}; CPU {total/100:.1f} s over all processes", flush=True)
    for pid, d in sorted(procs.items(), key=lambda kv: -kv[1])[:12]:
        print(f"   {d/100:6.2f} s  {pid} {title(pid)}", flush=True)
    print("   busy threads: " + ", ".join(f"{n}@{pid}:{d/100:.1f}s(cpu{c})" for d, pid, n, c in sorted(threads, reverse=True)[:14]), flush=True)
for r in range(int(sys.argv[1])):
    for kind in sys.argv[2].split(","):
        work = Path(tempfile.mkdtemp(prefix="cpu-"))
        if kind.startswith("daemon"):
            config = {"engine": {"max_model_len": 1024, **({"executor": "mp"} if kind == "daemon_mp" else {})},
                      "ray": {"address": ""}, "supervisor": {"routing": "prefix", **({"standby": "none"} if kind == "daemon_mp" else {})}}
            flags = ("--data-parallel-size", "2", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log")
            env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if kind == "daemon_nobind" else None
            with Daemon(work, config, env=env, args=flags, own_session=True).start() as d:
                d.wait_ready(); d.wait_replicas_serving(); d.wait_standby()
                a = snap(); row = measure(d.base_url, args); b = snap()
                report(kind, row, a, b)
                d.stop()
        else:
            s = VllmServe(work, None, extra=("--data-parallel-size", "2", "--enable-prompt-tokens-details")).start()
            try:
                s.wait_ready()
                a = snap(); row = measure(s.base_url, args); b = snap()
                report(kind, row, a, b)
            finally:
                s.stop()
