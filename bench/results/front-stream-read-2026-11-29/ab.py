"""Does the checked-out stream path cost less per token than another commit's? Three servers in
alternating rounds, each loaded at saturation (2000 prompts, 8 at a time, 32 in / 64 out), the
front's event-loop thread's CPU per output token read from ``/proc`` schedstat: ``vllm serve``,
the daemon of the work tree (``standby = "none"``), and the same daemon run from a detached
worktree of ``REF`` (put first on that daemon's ``PYTHONPATH``, so its ``supervisor`` and
``executor`` packages are ``REF``'s). The Ray head and its workers are shared; the change
measured here is in the front only.

    PYTHONPATH=. .venv/bin/python bench/results/front-stream-read-2026-11-29/ab.py REF [rounds]
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import RayHead, start_daemon
from bench.serving_overhead import ProbeLoad, alternating, loop_load, start, warm_up

ROOT = Path(__file__).resolve().parents[3]
KINDS = ["vllm_serve", "daemon_here", "daemon_ref"]


def launch(kind: str, work: Path, head: RayHead, ref_tree: Path):
    if kind != "daemon_ref":
        return start("daemon_standby_none" if kind == "daemon_here" else kind, work, head)
    server = start_daemon(work, head, env={"PYTHONPATH": str(ref_tree)}, standby="none")
    server.wait_ready()
    return server


def main() -> None:
    ref = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    work = Path(tempfile.mkdtemp(prefix="front-ab-"))
    ref_tree = work / "ref"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(ref_tree), ref], check=True)
    here = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(f"here: {here.strip()}, ref: {ref}", flush=True)
    head = RayHead(num_cpus=2).start()
    try:
        for r, kind in alternating(KINDS, rounds):
            (work / f"{kind}-{r}").mkdir()
            server = launch(kind, work / f"{kind}-{r}", head, ref_tree)
            try:
                warm_up(server, work / f"{kind}-{r}", f"{kind}-{r}", ProbeLoad)
                print(f"round {r + 1} {kind}: {loop_load(server, work / f'{kind}-{r}', f'{kind}-{r}')}", flush=True)
            finally:
                server.stop()
    finally:
        head.stop()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(ref_tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
