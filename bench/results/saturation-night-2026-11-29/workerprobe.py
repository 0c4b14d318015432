"""What the saturation bench's three Ray V2 servers run their one worker with: `vllm serve` on Ray V2,
the daemon with its defaults (warm standby) and with ``standby = "none"``, each started as
``bench.serving_overhead`` starts it on one Ray head, after one completion: the worker's and the
engine core's OpenMP and preload variables, their threads (name, allowed cores: count), and what
each server's log says about asynchronous scheduling and the worker's OpenMP binding.

    PYTHONPATH=. .venv/bin/python bench/results/saturation-night-2026-11-29/workerprobe.py vllm_serve daemon daemon_standby_none

Each process is described by ``factprobe.describe`` (2026-11-28), which also prints its niceness and
the OpenMP and allocator libraries mapped; ``workerprobe.log`` was made with a copy of it without
those two lines.
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-step-2026-11-28"))
from factprobe import describe  # noqa: E402

from bench import serving_overhead as so  # noqa: E402
from bench.common import MODEL_NAME, tree  # noqa: E402
from chaos.harness import RayHead  # noqa: E402

NAMES = ("Worker", "StandbyRay", "EngineCor", "RayWorker", "Supervised")
LOG = re.compile(r"async(hronous)?.?scheduling|OpenMP|OMP_NUM_THREADS|thread binding", re.I)


def main() -> None:
    head = RayHead().start()
    try:
        for kind in sys.argv[1:]:
            print("==", kind, flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                server = so.start(kind, Path(tmp), head)
                try:
                    httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                               json={"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 8}).raise_for_status()
                    for pid in tree(server.proc.pid, head.marker):
                        try:
                            if any(k in open(f"/proc/{pid}/comm").read() for k in NAMES):
                                describe(pid)
                        except OSError:
                            pass
                    seen = []
                    for line in Path(server.log_path).read_text(errors="replace").splitlines():
                        text = re.sub(r"^.*?(INFO|WARNING|DEBUG)\s+\S+\s+\S+\s+", "", line)
                        if LOG.search(line) and text not in seen:
                            seen.append(text)
                    print("    log:", *[s[:240] for s in seen[:8]], sep="\n      ")
                finally:
                    server.stop()
            sys.stdout.flush()
    finally:
        head.stop()


if __name__ == "__main__":
    main()
