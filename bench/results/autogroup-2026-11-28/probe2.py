"""Start `kind` servers one after another; for each, run saturation loads and record, per
process and thread: affinity, last core, CPU time, during the load. Find what a collapsed round differs in."""
import json, os, sys, time, threading, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main")
from bench.common import VllmServe, bench_serve, tree, RayHead
from bench.serving_overhead import start, vllm_histograms

def threads(pid):
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
                name = st[st.index("(")+1:st.rindex(")")]
                f = st[st.rindex(")")+2:].split()
                aff = os.sched_getaffinity(int(tid))
                out[int(tid)] = (name, int(f[11]) + int(f[12]), int(f[36]), sorted(aff), int(f[16]))  # utime+stime, processor, affinity, nice
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
    except FileNotFoundError:
        pass
    return out

def cmd(pid):
    try: return open(f"/proc/{pid}/cmdline","rb").read().split(b"\0")[0].decode()[:40]
    except Exception: return "?"

kind, n, session = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import subprocess
_Popen = subprocess.Popen
class Popen(_Popen):
    def __init__(self, args, *a, **kw):
        if any(("api_server" in str(x) or "vllm-supervisor" in str(x)) for x in args):
            kw["start_new_session"] = session == "own"
        super().__init__(args, *a, **kw)
subprocess.Popen = Popen
if session == "shared":
    os.killpg = lambda pid, sig: os.kill(pid, sig)
work = Path(tempfile.mkdtemp(prefix="col-"))
head = RayHead(num_cpus=2).start()
try:
  for i in range(n):
    (work / f"{i}").mkdir()
    s = start(kind, work / f"{i}", head, ("--max-model-len", "1024") if False else ())
    try:
        bench_serve(s.base_url, work/f"{i}", "warm", 8, float("inf"), 32, 64, seed=99)
        pids = tree(s.proc.pid, None)
        before = {p: threads(p) for p in pids}
        st0 = vllm_histograms(s.base_url)["steps"]
        r = bench_serve(s.base_url, work/f"{i}", "load", 300, float("inf"), 32, 64, seed=0, max_concurrency=8)
        after = {p: threads(p) for p in pids}
        st1 = vllm_histograms(s.base_url)["steps"]
        tps = (st1[1]-st0[1])/max(1, st1[0]-st0[0])
        print(f"== {kind} ({session} session) server {i} autogroup {open(f'/proc/{s.proc.pid}/autogroup').read().split()[0]} client {open('/proc/self/autogroup').read().split()[0]}: {r['request_throughput']:.1f} req/s, {tps:.2f} tokens/step", flush=True)
        for p in pids:
            busy = []
            for tid, (name, t, cpu, aff, nice) in after[p].items():
                d = t - before[p].get(tid, (0, 0))[1]
                if d >= 2:
                    busy.append(f"{name}:{d}t@cpu{cpu}{'' if len(aff)==os.cpu_count() else ' aff'+str(aff)}{' nice'+str(nice) if nice else ''}")
            paff = sorted(os.sched_getaffinity(p)) if os.path.exists(f"/proc/{p}") else None
            print(f"  {p} {cmd(p)} aff={paff}: " + ", ".join(busy), flush=True)
    finally:
        s.stop()
finally:
    head.stop()
