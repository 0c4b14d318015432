"""Which core the front's event-loop thread runs on, and beside what, in ``vllm serve`` and the
daemon: during a saturation load (2000 prompts, 8 at a time, 32 in / 64 out), every 5 ms, the
core each thread of the server's tree last ran on and whether it is running (``/proc/<pid>/
task/<tid>/stat``: state, field 39), in alternating rounds. Prints, per server, the loop
thread's allowed cores, its share of samples on each core, and the share of those samples in
which another thread of the tree was running on the same core.

    PYTHONPATH=. .venv/bin/python bench/results/front-cores-2026-11-29/where.py [rounds]
"""

import collections
import sys
import threading
import time
from pathlib import Path

from bench.common import bench_serve
from bench.serving_overhead import ProbeLoad, warm_rounds


def tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids[ppid].append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def threads(pids: list[int]) -> list[tuple[int, int, str, str, int]]:
    """(pid, tid, name, state, last core) of every thread of ``pids``."""
    rows = []
    for pid in pids:
        try:
            tids = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for t in tids:
            try:
                text = (t / "stat").read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            rows.append((pid, int(t.name), name, fields[0], int(fields[36])))
    return rows


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for r, kind, server, work, _ in warm_rounds(["vllm_serve", "daemon"], rounds, "front-cores-", ProbeLoad):
        pid = server.proc.pid
        stop = threading.Event()
        on = collections.Counter()  # loop running, on core c
        shared = collections.Counter()  # ... while another running thread of the tree was on c
        beside = collections.Counter()  # who that was

        def watch() -> None:
            time.sleep(5)
            pids = tree(pid)
            while not stop.is_set():
                rows = threads(pids)
                me = [row for row in rows if row[1] == pid]
                if me and me[0][3] == "R":
                    core = me[0][4]
                    on[core] += 1
                    others = [row for row in rows if row[1] != pid and row[3] == "R" and row[4] == core]
                    if others:
                        shared[core] += 1
                        for row in others:
                            beside[row[2]] += 1
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        bench_serve(server.base_url, work, f"{kind}-{r}", 2000, float("inf"), 32, 64, max_concurrency=8, client_nice=-10)
        stop.set()
        watcher.join()
        allowed = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Cpus_allowed_list")]
        n = sum(on.values())
        print(f"round {r + 1} {kind}: {allowed[0] if allowed else '?'}; loop running in {n} samples: "
              + ", ".join(f"core {c} {100 * k / n:.0f} % (another thread of the tree running there in {100 * shared[c] / max(1, k):.0f} %)"
                          for c, k in sorted(on.items()))
              + "; beside it: " + ", ".join(f"{name} {k}" for name, k in beside.most_common(5)), flush=True)


if __name__ == "__main__":
    main()
