"""Shared pieces of the benchmarks: the two servers (``vllm serve`` with our executor, and the
daemon), vLLM's own benchmark client, and ratio tables."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from chaos.harness import OPERATOR_ENV, Daemon, RayHead, demo_model_path, free_port, shm_segments
from chaos.load import RequestRecord
from executor.shm import sweep

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "demo-tiny-llama"
EXECUTOR = "executor.ray_v2.SupervisedRayExecutor"


class VllmServe:
    """``vllm serve`` (through its API server module: the CPU build's CLI is broken) with
    our executor class, on the same Ray cluster and engine settings as the daemon."""

    def __init__(self, workdir: Path, head: RayHead | None, tp: int = 1, max_model_len: int = 1024,
                 extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"vllm-serve-{self.port}.log"
        self.cmd = [
            # The CPU build's CLI entry (`vllm serve`, vllm.entrypoints.cli.main) fails looking up
            # the `vllm` distribution's version; the API server module is the same server.
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(demo_model_path()),
            "--served-model-name", MODEL_NAME, "--port", str(self.port), "--host", "127.0.0.1",
            "--tensor-parallel-size", str(tp), "--max-model-len", str(max_model_len), "--dtype", "float32",
            "--enforce-eager", "--seed", "0", "--disable-uvicorn-access-log", *extra,
        ]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if head is not None:  # our executor class on the daemon's Ray cluster; else vLLM's default
            self.cmd += ["--distributed-executor-backend", EXECUTOR]
            env.update(head.env, RAY_ADDRESS=head.address)
        self.env = dict(os.environ, **env)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "VllmServe":
        self.shm_before = shm_segments()
        self.own_segments: set[str] = set()  # the /dev/shm segments its own processes were seen to map
        self._log = open(self.log_path, "wb")
        # its scratch files in a directory of its own, removed at its stop: `vllm serve` leaves
        # the files of its ZeroMQ sockets in the temporary directory (7 per start, 14 with
        # --data-parallel-size 2), as the daemon would without its sweep (``executor.ipc``)
        self.scratch = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(self.env, TMPDIR=str(self.scratch)), cwd=ROOT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 300) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/v1/models", timeout=2).status_code == 200:
                    self.remember_segments()
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"vllm serve not ready in {timeout_s} s")

    def remember_segments(self) -> None:
        """Record the new ``/dev/shm`` segments that this server's own processes map now."""
        from executor.reaper import descendants
        from executor.shm import mapped_segments

        if self.proc is not None and self.proc.poll() is None:
            pids = {self.proc.pid} | {pid for pid, _ in descendants(self.proc.pid)}
            self.own_segments |= mapped_segments(pids=pids) - self.shm_before

    def stop(self) -> int:
        self.remember_segments()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # vllm serve leaves a shared-memory segment behind when stopped or when its worker dies
        # (its resource tracker warns "leaked shared_memory"): remove what it mapped and nobody maps
        # now. Only its own: a daemon running beside it keeps its leftovers for its own leak check.
        sweep(self.own_segments)
        shutil.rmtree(self.scratch, ignore_errors=True)
        return self.proc.returncode


    def request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return httpx.request(method, self.base_url + path, timeout=kw.pop("timeout", 120), **kw)
        finally:
            self.remember_segments()


def plain_vllm_serve(workdir: Path, *extra: str, max_model_len: int = 256) -> VllmServe:
    """A plain ``vllm serve`` of the demo model (vLLM's default executor, no Ray) with the
    daemon's demo-model defaults, not yet started: the reference a drop-in is compared with."""
    return VllmServe(workdir, None, max_model_len=max_model_len, extra=extra)


def start_daemon(workdir: Path, head: RayHead, tp: int = 1, max_model_len: int = 1024, executor: str = "ray",
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None, **supervisor: Any) -> Daemon:
    config = {"engine": {"tensor_parallel_size": tp, "max_model_len": max_model_len, "executor": executor},
              "ray": {"address": head.address}, "supervisor": supervisor}
    # the same front-end flag as VllmServe: vLLM's access log off in both; in a session of its
    # own, as VllmServe starts `vllm serve`, so the kernel's autogroups weigh both alike against
    # the benchmark client (in this process's session)
    return Daemon(workdir, config, env={**OPERATOR_ENV, **(env or {})}, args=("--disable-uvicorn-access-log", *extra), own_session=True).start()


def prioritise(pid: int, nice: int) -> None:
    """Give ``pid``, alone in a session of its own, the niceness ``nice`` where the kernel weighs
    it: its session's autogroup (CFS shares a CPU between sessions first) and its own. For the
    benchmark client on a host of few cores: a server's engine core and worker spin between steps
    and hold both cores, and a client in an ordinary session then waits on a run queue for up to
    a second at a time (docs/benchmarks.md, "whose stalls"), which a client on another host never
    does. Needs root (CI runs as root); otherwise the client keeps its weight, said on stderr."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError as exc:
        print(f"the benchmark client keeps its CPU weight (niceness {nice} refused: {exc})", file=sys.stderr)


def bench_serve(base_url: str, result_dir: Path, name: str, num_prompts: int, rate: float, input_len: int,
                output_len: int, seed: int = 0, max_concurrency: int | None = None, client_nice: int = 0) -> dict[str, Any]:
    """vLLM's benchmark client (``vllm bench serve``) through its module, in a subprocess; with
    ``client_nice`` (e.g. -10) in a session of its own at that niceness (``prioritise``)."""
    code = (
        "import argparse, sys\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
    )
    args = [
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", MODEL_NAME,
        "--tokenizer", str(demo_model_path()), "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts), "--request-rate", str(rate),
        "--seed", str(seed), "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json",
        *(["--max-concurrency", str(max_concurrency)] if max_concurrency else []),
    ]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, start_new_session=bool(client_nice))
    if client_nice:
        prioritise(proc.pid, client_nice)
    try:
        _, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve failed: {stderr[-2000:]}")
    import json

    return json.loads((result_dir / f"{name}.json").read_text())


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used, from ``/proc``."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_schedstat(pid: int, tid: int | None = None) -> tuple[float, float, int]:
    """(seconds on a core, seconds waiting for one while runnable, times it was run) of one
    thread, the main one by default (an asyncio server's event loop): the kernel's
    ``/proc/<pid>/task/<tid>/schedstat``."""
    run_ns, wait_ns, slices = Path(f"/proc/{pid}/task/{tid or pid}/schedstat").read_text().split()
    return int(run_ns) / 1e9, int(wait_ns) / 1e9, int(slices)


class HostSteal:
    """The share of the machine's CPU time its hypervisor gave to others while a window ran
    (``steal`` in ``/proc/stat``, % of all cores). A virtual machine's speed that comes and goes
    with its neighbours shows here; a pinned thread cannot run on the other core meanwhile."""

    def __init__(self):
        self.started, self.steal = time.monotonic(), self.read()

    @staticmethod
    def read() -> float:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0

    def pct(self) -> float:
        took = max(1e-6, time.monotonic() - self.started)
        return round(100 * (self.read() - self.steal) / (took * (os.cpu_count() or 1)), 3)


# ``HostSpeed``'s fixed work, in a process of its own: small float32 matrix products on one
# thread (a model's kind of work, in the core's caches), a Python loop (a front's), and a sum
# over 16 MiB (more than the caches hold: the memory's bandwidth), each timed by the CPU time it
# took (``time.thread_time``: waiting for a core is not counted), one sample every PERIOD s.
_SPEED_WORK = """
import sys, time
import numpy as np
a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
big = np.ones(4 << 20, dtype=np.float32)
def sample():
    t0 = time.thread_time()
    for _ in range(32):
        a @ a
    t1 = time.thread_time()
    s = 0
    for i in range(20000):
        s += i * i
    t2 = time.thread_time()
    big.sum()
    t3 = time.thread_time()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3
sample()
while True:
    print("%.4f %.4f %.4f" % sample(), flush=True)
    time.sleep(float(sys.argv[1]))
"""


class HostSpeed:
    """The host's speed while a window ran: how much CPU time a fixed piece of work took
    (``_SPEED_WORK``, ≈ 3 ms every half second in a process of its own: ≈ 0.6 % of a core). On
    a virtual machine a neighbour can slow a core without any steal (the other thread of a
    shared core, its caches, its memory bandwidth): the same work then takes more CPU time, and so
    does a server's. ``stop()``: the median ms of each part over the window; windows whose work
    took longer ran on a slower host."""

    PERIOD_S = 0.5
    PARTS = ("matmul", "python", "memory")

    def __init__(self):
        one = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        self.proc = subprocess.Popen([sys.executable, "-c", _SPEED_WORK, str(self.PERIOD_S)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env={**os.environ, **one})

    def stop(self) -> dict[str, float | int | None]:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        samples = [tuple(map(float, line.split())) for line in out.splitlines() if len(line.split()) == len(self.PARTS)]
        result: dict[str, float | int | None] = {
            f"host_{part}_ms": round(statistics.median(s[i] for s in samples), 4) if samples else None
            for i, part in enumerate(self.PARTS)}
        return {**result, "host_speed_samples": len(samples)}


def host_work(result: dict) -> str:
    """The host gauge's parts (``HostSpeed``) in CPU ms, as "matmul + python + memory"."""
    return " + ".join(f"{result.get(f'host_{part}_ms') or 0:.3f}" for part in HostSpeed.PARTS)


def tree(roots: list[int] | int, marker: str | None = None) -> list[int]:
    """``roots`` and their descendants, plus the processes carrying ``marker`` (a Ray head's)."""
    from chaos.harness import marked_pids
    from executor.reaper import descendants

    roots = [roots] if isinstance(roots, int) else list(roots)
    roots += marked_pids(marker) if marker else []
    return sorted(set(roots) | {pid for root in roots for pid, _ in descendants(root)})


def tree_cpu_s(pids: list[int]) -> dict[int, float]:
    """CPU seconds of each of ``pids`` still alive."""
    out = {}
    for pid in pids:
        try:
            out[pid] = cpu_s(pid)
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    return out


def process_usage(pids: dict[str, int], window_s: float) -> dict[str, dict[str, float]]:
    """Each process's CPU (user + system, % of a core) over the next ``window_s`` and its RSS
    (MiB) at the end, from ``/proc`` (same host only)."""
    def rss_mib(pid: int) -> float:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024

    before = {k: cpu_s(p) for k, p in pids.items()}
    time.sleep(window_s)
    return {k: {"rss_mib": round(rss_mib(p)), "cpu_pct": round(100 * (cpu_s(p) - before[k]) / window_s, 2)}
            for k, p in pids.items()}


def spread(values: list[float]) -> str:
    if not values:  # e.g. every round of a daemon rebuilt its engine: no step figures
        return "n/a"
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def p99(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def gaps_in(records: list[RequestRecord], start: float, end: float, clients: int) -> list[float]:
    """Per client: the largest wait it saw inside [start, end] (between chunks, or from
    sending a request to its first chunk)."""
    worst = [0.0] * clients
    for r in records:
        times = [r.started, *r.chunk_times]
        for a, b in zip(times, times[1:]):
            if b >= start and a <= end:
                worst[r.index] = max(worst[r.index], b - a)
    return worst


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return parser
