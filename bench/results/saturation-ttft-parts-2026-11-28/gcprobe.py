import json, os, sys, time, tempfile, glob
from pathlib import Path
sys.path.insert(0, "/work/main")
from bench.common import bench_serve, RayHead
from bench.serving_overhead import start
work = Path(tempfile.mkdtemp(prefix="gcp-"))
head = RayHead(num_cpus=2).start()
try:
    for i, kind in enumerate(sys.argv[1:]):
        (work / f"{i}").mkdir()
        s = start(kind, work / f"{i}", head)
        try:
            bench_serve(s.base_url, work/f"{i}", "warm", 8, float("inf"), 32, 64, seed=99)
            t0 = time.time()
            r = bench_serve(s.base_url, work/f"{i}", "load", 300, float("inf"), 32, 64, seed=0, max_concurrency=8)
            t1 = time.time()
            time.sleep(6)
            f = Path(os.environ["GCPROBE_DIR"]) / f"{s.proc.pid}.json"
            d = json.loads(f.read_text())
            ev = [e for e in d["events"] if t0 <= e[0] <= t1]
            by = {g: [x[2] for x in ev if x[1] == g] for g in (0, 1, 2)}
            print(f"== {kind}: {r['request_throughput']:.1f} req/s TTFT p50 {r['p50_ttft_ms']:.1f} p99 {r['p99_ttft_ms']:.1f}; "
                  f"objects {d['objects']} frozen {d['frozen']}; window {t1-t0:.1f} s", flush=True)
            for g in (0, 1, 2):
                xs = by[g]
                print(f"   gen{g}: {len(xs)} collections, {1000*sum(xs):.1f} ms total, max {1000*max(xs, default=0):.2f} ms, mean {1000*sum(xs)/max(1,len(xs)):.3f} ms", flush=True)
        finally:
            s.stop()
finally:
    head.stop()
