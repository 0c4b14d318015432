"""Why a Ray V2 replica's engine step is sometimes longer than an ``mp`` one's (stepprobe, 2026-11-28):
the same chat load as ``bench.prefix_routing`` (client at -10) against the daemon's 2 replicas on
Ray V2 (``prefix``) and on ``mp`` (``prefix_mp``), alternating; per round:

* the load's took and vLLM's mean inter-token latency over both engines (about one step);
* the host's CPU from ``/proc/stat`` over the load (user, system, steal, idle; cores);
* every thread of the daemon's tree, CPU over the load, summed by (process name, thread name);
* a ``py-spy record --nonblocking`` (Python frames, 20 Hz) of each worker over the load: the
  frames most often on top, and the share of samples inside the model's forward.

    PYTHONPATH=. .venv/bin/python bench/results/ray-worker-step-2026-11-29/threadprobe2.py ROUNDS OUTDIR
"""
from __future__ import annotations

import collections
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-step-2026-11-28"))
import stepprobe  # noqa: E402

from bench import prefix_routing as pr  # noqa: E402
from bench.common import tree  # noqa: E402
from chaos.harness import Daemon  # noqa: E402

ITL = "vllm:inter_token_latency_seconds"
WORKER_NAMES = ("Worker", "StandbyRay")


def itl(base_url):
    """vLLM's inter-token latency histogram over both engines: [sum, count] (``stepprobe.hists``)."""
    h = stepprobe.hists(base_url)
    return [h[(ITL, "sum")], h[(ITL, "count")]]


def host():
    """user, system, idle, steal (jiffies) from /proc/stat's cpu line."""
    f = list(map(int, open("/proc/stat").readline().split()[1:]))
    return {"user": f[0] + f[1], "system": f[2] + f[5] + f[6], "idle": f[3] + f[4], "steal": f[7]}


def threads(root):
    """(process name, thread name) -> CPU s, every thread of ``root``'s tree."""
    out = collections.Counter()
    for pid in tree(root):
        try:
            pname = open(f"/proc/{pid}/comm").read().strip()
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                tname = (task / "comm").read_text().strip()
                out[(f"{pname}@{pid}", tname)] += int((task / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                pass
    return out


def named(root, names) -> list[int]:
    """The processes of ``root``'s tree whose name (``comm``) contains one of ``names``."""
    out = []
    for pid in tree(root):
        try:
            if any(k in open(f"/proc/{pid}/comm").read() for k in names):
                out.append(pid)
        except OSError:
            pass
    return out


def workers(root):
    return named(root, WORKER_NAMES)


def summarise(raw: Path) -> str:
    """Top self frames and the share of samples under the model's forward, from py-spy's raw output."""
    top, total, forward = collections.Counter(), 0, 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        n = int(n)
        total += n
        frames = stack.split(";")
        top[frames[-1]] += n
        if any("forward" in f for f in frames):
            forward += n
    lines = [f"      {100 * n / max(1, total):5.1f} %  {f[:150]}" for f, n in top.most_common(8)]
    return f"    samples {total}, under a forward {100 * forward / max(1, total):.1f} %\n" + "\n".join(lines)


def start_spies(pids, out: Path, r: int, kind: str, rate: int = 20, *flags: str) -> dict:
    """A ``py-spy record --nonblocking`` (``rate`` Hz, raw, more ``flags``) of each of ``pids`` into
    ``out/r<r>-<kind>-<pid>.txt``, until ``stop_spies``."""
    return {pid: subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking", "--rate", str(rate),
                                   *flags, "--format", "raw", "--pid", str(pid), "--output", str(out / f"r{r}-{kind}-{pid}.txt")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for pid in pids}


def stop_spies(spies: dict) -> None:
    for spy in spies.values():
        spy.send_signal(signal.SIGINT)
    for spy in spies.values():
        spy.wait(timeout=30)


def print_breakdown(t0, t1, spies: dict, out: Path, r: int, kind: str) -> None:
    """The threads that took the most CPU over the load, and each spied process's top frames."""
    delta = collections.Counter({k: v - t0.get(k, 0.0) for k, v in t1.items()})
    for (p, t), s in delta.most_common(14):
        print(f"    {p:<24} {t:<18} {s:6.2f} s", flush=True)
    for pid in spies:
        raw = out / f"r{r}-{kind}-{pid}.txt"
        if raw.exists():
            print(f"  py-spy {pid}:\n" + summarise(raw), flush=True)


def one(kind, args, out: Path, r: int):
    config, flags = pr.daemon_setup(kind)
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), config, args=flags, own_session=True).start() as d:
        d.wait_ready(); d.wait_replicas_serving(); d.wait_standby()
        spies = start_spies(workers(d.proc.pid), out, r, kind)
        i0, h0, t0 = itl(d.base_url), host(), threads(d.proc.pid)
        row = pr.measure(d.base_url, args)
        i1, h1, t1 = itl(d.base_url), host(), threads(d.proc.pid)
        stop_spies(spies)
        took = row["took_s"]
        mean_itl = 1000 * (i1[0] - i0[0]) / max(1, i1[1] - i0[1])
        print(f"round {r} {kind}: took {took} s, TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms, "
              f"mean ITL {mean_itl:.1f} ms; host (cores): " + ", ".join(
                  f"{k} {(h1[k] - h0[k]) / 100 / took:.2f}" for k in h0), flush=True)
        print_breakdown(t0, t1, spies, out, r, kind)
        d.stop()


def main():
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    args = pr.workload_parser().parse_args(["--client-nice", "-10"])
    kinds = ["prefix", pr.PREFIX_MP]
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            one(kind, args, out, r)


if __name__ == "__main__":
    main()
