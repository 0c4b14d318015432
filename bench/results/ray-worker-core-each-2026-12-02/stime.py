"""Per-process user and system time over 20 s of each of a probe's loads (a load runs while its
``py-spy`` records do), the 12 with the most system time first.

    .venv/bin/python bench/results/ray-worker-core-each-2026-12-02/stime.py LOADS PROBE_LOG

``PROBE_LOG`` is ``coreprobe_each.py``'s output: the rounds it printed number the load read.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from executor import procfs  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def snap() -> dict[int, tuple[str, int, int]]:
    """pid -> (command name, user ticks, system ticks) of every process readable now."""
    out = {}
    for pid in procfs.pids():
        fields, comm = procfs.stat(pid), procfs.read(pid, "comm")
        if fields is not None and comm is not None:
            out[pid] = (comm.decode().strip(), int(fields[11]), int(fields[12]))
    return out


def spying() -> bool:
    return subprocess.run(["pgrep", "py-spy"], capture_output=True).returncode == 0


def main() -> None:
    loads, probe_log = int(sys.argv[1]), Path(sys.argv[2])
    for _ in range(loads):
        while not spying():
            time.sleep(1)
        time.sleep(5)
        a, t = snap(), time.time()
        time.sleep(20)
        b, dt = snap(), time.time() - t
        rows = sorted(((b[p][2] - a[p][2], b[p][1] - a[p][1], p, b[p][0]) for p in b if p in a), reverse=True)
        load = sum(line.startswith("round ") for line in probe_log.read_text().splitlines())
        print(f"--- load #{load} at {time.strftime('%H:%M:%S')}: total stime {sum(r[0] for r in rows) / TICK / dt:.3f} "
              f"cores, utime {sum(r[1] for r in rows) / TICK / dt:.3f}")
        for st, ut, pid, comm in rows[:12]:
            print(f"  {comm:20s} {pid:7d} stime {st / TICK / dt:.3f} utime {ut / TICK / dt:.3f}", flush=True)
        while spying():
            time.sleep(1)


if __name__ == "__main__":
    main()
