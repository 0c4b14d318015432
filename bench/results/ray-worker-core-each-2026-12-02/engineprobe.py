"""What a Ray V2 replica's engine core does that an ``mp`` one's does not (``coreprobe_each.py``
found its CPU 25-55 % higher in its first two rounds, 2026-12-02, and lower in the third): the same
load and daemons, with a
``py-spy record --threads --nonblocking`` of each engine core instead of the workers; per kind, the
frames most often on top for each Python thread, and the share of samples each thread took.

    PYTHONPATH=. .venv/bin/python bench/results/ray-worker-core-each-2026-12-02/engineprobe.py ROUNDS OUTDIR
"""
from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-step-2026-11-29"))
sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-step-2026-11-28"))
import threadprobe2 as tp  # noqa: E402

from bench import prefix_routing as pr  # noqa: E402
from chaos.harness import Daemon  # noqa: E402


def tasks(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU s) of every thread of ``pid``, from ``/proc``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = ((task / "comm").read_text().strip(), int((task / "schedstat").read_text().split()[0]) / 1e9)
        except (OSError, ValueError, IndexError):
            pass
    return out


def summarise(raw: Path) -> str:
    """Per thread (py-spy's first frame): its share of the samples and its top self frames."""
    per, total = collections.defaultdict(collections.Counter), 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        per[frames[0]][frames[-1]] += int(n)
        total += int(n)
    out = [f"    samples {total}"]
    for thread, top in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(top.values())
        out.append(f"    {100 * n / max(1, total):5.1f} %  {thread[:90]}")
        out += [f"          {100 * c / n:5.1f} %  {f[:140]}" for f, c in top.most_common(6)]
    return "\n".join(out)


def one(kind: str, args, out: Path, r: int) -> None:
    config, flags = pr.daemon_setup(kind)
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), config, args=flags, env=dict(pr.CORE_EACH_ENV),
                                                      own_session=True).start() as d:
        d.wait_ready(); d.wait_replicas_serving(); d.wait_standby()
        pids = tp.named(d.proc.pid, ("EngineCor",))
        spies = tp.start_spies(pids, out, r, f"{kind}-core", 50, "--threads")
        before = {pid: tasks(pid) for pid in pids}
        row = pr.measure(d.base_url, args)
        after = {pid: tasks(pid) for pid in pids}
        tp.stop_spies(spies)
        print(f"round {r} {kind}: took {row['took_s']} s, TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms",
              flush=True)
        for pid in pids:
            raw = out / f"r{r}-{kind}-core-{pid}.txt"  # tp.start_spies's name
            cpu = sorted(((v[1] - before[pid].get(tid, (v[0], 0.0))[1], tid, v[0]) for tid, v in after[pid].items()),
                         reverse=True)
            print(f"  engine core {pid}: {sum(c for c, _, _ in cpu):.2f} CPU s; threads (tid, name, CPU s): "
                  + ", ".join(f"{tid} {name} {c:.2f}" for c, tid, name in cpu[:8]), flush=True)
            if raw.exists():
                print(summarise(raw), flush=True)
        d.stop()


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    args = pr.workload_parser().parse_args(["--client-nice", "-10", "--conversations", "128"])
    kinds = [pr.PREFIX_CORE_EACH, pr.PREFIX_MP_CORE_EACH]
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            one(kind, args, out, r)


if __name__ == "__main__":
    main()
