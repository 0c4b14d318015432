"""What of the ready standby costs two replicas' first token, once its workers are stopped (issue 42,
2026-12-04). On 2026-12-03 the standby's workers stopped (SIGSTOP) over the load took back about half
of what an idle standby costs (``standby-stopped.log``: TTFT p50 83 ms with the defaults, 77 stopped,
72 with no idle standby). What stayed was the fork server, the daemon's own bookkeeping of a ready
standby (its Ray agent's handles, the GCS's and raylet's records of two more actors) and the
standby's memory. Two kinds more than ``coreprobe_each.py``'s, on the same load (the 128-conversation
chat on two Ray V2 replicas bound a core each, client at -10):

- ``prefix_core_each_standby_frozen``: the defaults with every process of the ready standby stopped
  (the workers and the engine core's fork server; SIGCONT before the daemon stops). Nothing of the
  standby runs; its memory, its Ray records and the agent's handles stay.
- ``prefix_core_each_without_idle_ballast``: no idle standby (``standby_without=idle``), and beside
  the daemon a process of about the standby's memory, asleep: torch and vLLM's worker imported, then
  anonymous memory touched page by page up to ``BALLAST_MIB``, then ``signal.pause()``. Memory
  without any of Ray's records.

    PYTHONPATH=. .venv/bin/python bench/results/standby-frozen-2026-12-04/frozen.py ROUNDS OUTDIR KIND ...

Any kind with ``_settled`` after its name waits ``SETTLE_S`` (60 s) between the daemon ready (its
standby ready, if it has one) and the load, as a server that has been up a while: the 2026-12-04
rounds found the standby frozen as slow as the defaults, so what is left may be a transient of its
making (the kernel's, Ray's or the daemon's work after it) that a measurement right after it catches.

KINDS: these two and ``coreprobe_each.py``'s (``prefix_core_each``, ``prefix_core_each_standby_stopped``,
``prefix_core_each_without_idle`` ...). Rounds alternate the order, ``--no-spies`` always.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-core-each-2026-12-02"))
import coreprobe_each as ce  # noqa: E402

from bench import prefix_routing as pr  # noqa: E402
from bench.serving_overhead import standby_pids, stopped  # noqa: E402
from bench.steady_state import pss_kib  # noqa: E402
from chaos.harness import Daemon  # noqa: E402
from supervisor.testhooks import ENV, STANDBY_WITHOUT_ENV  # noqa: E402

FROZEN = "prefix_core_each_standby_frozen"
BALLAST = "prefix_core_each_without_idle_ballast"
BALLAST_MIB = int(os.environ.get("BALLAST_MIB", "1900"))
BALLAST_CODE = f"""
import mmap, signal, sys
import torch, vllm.v1.worker.cpu_worker  # noqa: F401  (the libraries a standby worker maps)
m = mmap.mmap(-1, {BALLAST_MIB} << 20)
for i in range(0, len(m), 4096):
    m[i] = 1
print("ready", flush=True)
signal.pause()
"""


def pss_mib(pid: int) -> float:
    return pss_kib(pid) / 1024


@contextlib.contextmanager
def ballast():
    proc = subprocess.Popen([sys.executable, "-c", BALLAST_CODE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", "the ballast did not start"
        print(f"  ballast pid {proc.pid}: PSS {pss_mib(proc.pid):.0f} MiB, asleep", flush=True)
        yield proc
    finally:
        proc.kill()
        proc.wait()


SETTLE_S = float(os.environ.get("SETTLE_S", "60"))


@contextlib.contextmanager
def serving(kind: str):
    if kind.endswith("_settled"):
        with serving(kind.removesuffix("_settled")) as d:
            print(f"  settling {SETTLE_S:.0f} s before the load", flush=True)
            time.sleep(SETTLE_S)
            yield d
        return
    if kind not in (FROZEN, BALLAST):
        with original(kind) as d:
            yield d
        return
    config, flags = pr.daemon_setup(pr.PREFIX_CORE_EACH)
    env = dict(pr.CORE_EACH_ENV)
    if kind == BALLAST:
        env.update({ENV: "1", STANDBY_WITHOUT_ENV: "idle"})
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        d = stack.enter_context(Daemon(Path(tmp), config, args=flags, env=env, own_session=True).start())
        d.wait_ready(); d.wait_replicas_serving()
        pids: list[int] = []
        if kind == FROZEN:
            d.wait_standby()
            sb = d.status()["standby"]
            pids = standby_pids(d)
            assert len(pids) == len(sb["workers"]) + 1, f"a standby process without a pid: {sb}"
            print(f"  standby processes {pids} (PSS {sum(pss_mib(p) for p in pids):.0f} MiB) stopped over the load",
                  flush=True)
        else:
            stack.enter_context(ballast())
        with stopped(pids):
            yield d
        time.sleep(0.5)
        d.stop()


original = ce.serving
ce.serving = serving


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    args = pr.workload_parser().parse_args(["--client-nice", "-10", "--conversations", "128"])
    kinds = [k for k in sys.argv[3:] if k != "--no-spies"]
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            ce.one(kind, args, out, r, spy=False)


if __name__ == "__main__":
    main()
