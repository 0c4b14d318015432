"""cProfile of the front (vllm serve's API server process; the daemon's process) over the same
saturation load, alternating; the stats per output token, grouped by where the code lives.

    python frontprof.py ROUNDS vllm_serve,daemon_standby_none OUTDIR
    FRONTPROF_TIMER=thread python frontprof.py ...   (the thread's CPU time, not the wall clock)
"""
import os, signal, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "/work/main")
from bench.common import RayHead, VllmServe, bench_serve, start_daemon

here = Path(__file__).resolve().parent
rounds, kinds, out = int(sys.argv[1]), sys.argv[2].split(","), Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
extra_env = {"FRONTPROF_OUT": "", "PYTHONPATH": f"{here / 'site'}{os.pathsep}/work/main",
             "FRONTPROF_TIMER": os.environ.get("FRONTPROF_TIMER", "")}
head = RayHead(num_cpus=2).start()
try:
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            work = Path(tempfile.mkdtemp(prefix="fp-"))
            prefix = str(out / f"{kind}-r{r}")
            if kind == "vllm_serve":
                server = VllmServe(work, head)
                server.env.update(extra_env, FRONTPROF_OUT=prefix)
                server.start()
            else:
                import chaos.harness as h  # the same dict bench.common hands the daemon
                h.OPERATOR_ENV.update(extra_env, FRONTPROF_OUT=prefix)
                server = start_daemon(work, head, standby="none")
            try:
                server.wait_ready()
                bench_serve(server.base_url, work, "warm", 8, float("inf"), 32, 64, seed=99)
                pid = server.proc.pid
                os.kill(pid, signal.SIGUSR1)
                time.sleep(0.5)
                res = bench_serve(server.base_url, work, "load", 200, float("inf"), 32, 64, seed=0, max_concurrency=8)
                os.kill(pid, signal.SIGUSR1)
                time.sleep(3)
                print(kind, r, "req/s", round(res["request_throughput"], 2), "tokens", res["total_output_tokens"],
                      "stats", os.path.exists(f"{prefix}.{pid}"), flush=True)
                (out / f"{kind}-r{r}.tokens").write_text(f"{res['total_output_tokens']} {pid}\n")
            finally:
                server.stop()
finally:
    head.stop()
