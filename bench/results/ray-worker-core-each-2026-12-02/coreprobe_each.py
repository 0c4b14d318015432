"""Where a Ray V2 replica loses its TTFT p99 against an ``mp`` one with a core each (issue 42's
replica comparison, 2026-12-02): the longer chat load (``--conversations 128``, client at -10)
against the daemon's 2 replicas bound one core each (``VLLM_CPU_OMP_THREADS_BIND=0|1``), on
Ray V2 (``prefix_core_each``) and on ``mp`` (``prefix_mp_core_each``), alternating. Per round,
as ``threadprobe2.py`` (2026-11-29) does, plus the host gauge over the load
(``bench.common.HostSpeed``): the load's TTFT p50/p99 and took, vLLM's mean inter-token latency,
the host's CPU split, the CPU of every thread of the daemon's tree, and a ``py-spy`` of each
worker (top frames, share under a forward).

    PYTHONPATH=. .venv/bin/python bench/results/ray-worker-core-each-2026-12-02/coreprobe_each.py ROUNDS OUTDIR [--no-spies] [KIND ...]

``--no-spies``: no ``py-spy`` at all. Without it, the workers whose process name ``threadprobe2.workers``
matches are spied: an adopted worker (``ray::StandbyRay``), an idle standby and ``mp``'s workers, but not
the workers vLLM's Ray executor made (``ray::Supervised…``), so the kinds were not spied alike
(found 2026-12-03; unspied rounds in ``no-spies.log``, ``no-spies-2.log``, ``no-spies-parts.log``, ``no-spies-poll.log``, ``no-spies-idle.log``).

KINDS default to the two above; ``prefix_core_each_no_standby`` is Ray V2's with ``standby = "none"``;
``prefix_core_each_without_starter|idle|poll|park|starter_idle|starter_idle_preload`` are Ray V2's defaults with that part
(or both) of the warm standby left out (``supervisor.testhooks.standby_without``, as ``bench.serving_overhead`` does):
the workers created by vLLM's executor instead of adopted; no standby prepared after the build;
the ready standby not polled; its workers not parked (awake in Ray's task loop, as before 2026-12-03); the Ray
agent not importing the workers' class. ``prefix_core_each_standby_stopped``
is the defaults with the ready standby's workers stopped (SIGSTOP) over the load, and let go on (SIGCONT) before the daemon stops. They run with the test hooks on, whose only other effect on serving
is a per-step check in the worker for a poisoned request.
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-step-2026-11-29"))
sys.path.insert(0, str(Path(__file__).parents[1] / "ray-worker-step-2026-11-28"))
import threadprobe2 as tp  # noqa: E402

from bench import prefix_routing as pr  # noqa: E402
from bench.common import HostSpeed  # noqa: E402
from bench.serving_overhead import stopped  # noqa: E402
from chaos.harness import Daemon  # noqa: E402
from supervisor.testhooks import ENV, STANDBY_WITHOUT_ENV  # noqa: E402


NO_STANDBY = "prefix_core_each_no_standby"
# the defaults, with the ready standby's worker processes stopped (SIGSTOP) over the load: there,
# asleep for good, not one wake-up (Ray's 10 ms signal check, gRPC's pollers); SIGCONT before the stop
STOPPED = "prefix_core_each_standby_stopped"
WITHOUT = {f"prefix_core_each_without_{part.replace(',', '_')}": part for part in ("starter", "idle", "poll", "park", "starter,idle", "starter,idle,preload")}


@contextlib.contextmanager
def serving(kind: str):
    """The daemon of ``kind``, its replicas serving and its standby (if it has one) ready; stopped after."""
    config, flags = pr.daemon_setup(pr.PREFIX_CORE_EACH if kind in (NO_STANDBY, STOPPED) or kind in WITHOUT else kind)
    env = dict(pr.CORE_EACH_ENV)
    if kind == NO_STANDBY:
        config["supervisor"]["standby"] = "none"
    if kind in WITHOUT:
        env.update({ENV: "1", STANDBY_WITHOUT_ENV: WITHOUT[kind]})
    with tempfile.TemporaryDirectory() as tmp, Daemon(Path(tmp), config, args=flags, env=env,
                                                      own_session=True).start() as d:
        d.wait_ready(); d.wait_replicas_serving()
        if kind != NO_STANDBY and "idle" not in WITHOUT.get(kind, ""):
            d.wait_standby()
        workers = [w["pid"] for w in d.status()["standby"]["workers"]] if kind == STOPPED else []
        with stopped(workers):
            yield d
        if workers:
            print(f"  standby workers {workers} were stopped over the load", flush=True)
        d.stop()


def one(kind: str, args, out: Path, r: int, spy: bool = True) -> None:
    with serving(kind) as d:
        spies = tp.start_spies(tp.workers(d.proc.pid), out, r, kind) if spy else {}
        gauge = HostSpeed()
        i0, h0, t0 = tp.itl(d.base_url), tp.host(), tp.threads(d.proc.pid)
        row = pr.measure(d.base_url, args)
        i1, h1, t1 = tp.itl(d.base_url), tp.host(), tp.threads(d.proc.pid)
        speed = gauge.stop()
        tp.stop_spies(spies)
        took = row["took_s"]
        mean_itl = 1000 * (i1[0] - i0[0]) / max(1, i1[1] - i0[1])
        print(f"round {r} {kind}: took {took} s, TTFT p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms, "
              f"hit rate {row['hit_rate']:.3f}, mean ITL {mean_itl:.1f} ms, "
              f"gauge matmul {speed['host_matmul_ms']:.1f} ms; host (cores): " + ", ".join(
                  f"{k} {(h1[k] - h0[k]) / 100 / took:.2f}" for k in h0), flush=True)
        tp.print_breakdown(t0, t1, spies, out, r, kind)


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    args = pr.workload_parser().parse_args(["--client-nice", "-10", "--conversations", "128"])
    spy = "--no-spies" not in sys.argv[3:]
    kinds = [k for k in sys.argv[3:] if k != "--no-spies"] or [pr.PREFIX_CORE_EACH, pr.PREFIX_MP_CORE_EACH]
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            one(kind, args, out, r, spy)


if __name__ == "__main__":
    main()
