"""Fault injectors: look at and break a running daemon from outside, like an operator would.

    python -m chaos.inject --address HOST:PORT inspect [--match SUBSTRING]
    python -m chaos.inject --address HOST:PORT kill-worker [--rank N] [--match SUBSTRING]   # ray.kill
    python -m chaos.inject --address HOST:PORT signal-worker --signal KILL|STOP [--rank N]  # same host
    python -m chaos.inject --address HOST:PORT kill-all-workers [--match SUBSTRING]
    python -m chaos.inject kill-engine-core --daemon-pid PID                                 # SIGKILL

``inspect`` prints JSON: live placement groups and named actors (vLLM names its worker
actors ``vllm_Worker_<instance id>[_TP<r>][_PP<r>]``; the daemon's instance id is
``<daemon id>-g<generation>``). ``kill-worker`` calls ``ray.kill`` on one worker actor.
Without ``--match``, the worker commands target each daemon's serving engine (its lowest
live generation): the warm standby's actors already carry the next generation's names.
``kill-worker --standby`` kills a standby actor instead.
Ray 2.60 clusters use token auth: export the cluster's ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN`` as for any Ray client (docs/operating.md, "Chaos tools").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import signal
import sys
import time

from executor.engine import child_pids

WORKER_PREFIX = "vllm_Worker_"


def _connect(address: str) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")


def disconnect() -> None:
    """Leave the cluster (before stopping it: a driver that loses its GCS aborts after 60 s)."""
    if "ray" in sys.modules:
        import ray

        ray.shutdown()


def prepare(address: str) -> None:
    """Connect and import the worker actor's class now. ``ray.get_actor`` deserializes the
    class, which imports vLLM: seconds on a first call, which would make a fault land late."""
    _connect(address)
    importlib.import_module("executor.ray_v2")


def worker_rank(name: str) -> int:
    """Rank from a vLLM worker actor name (TP rank; 0 when TP=1)."""
    m = re.search(r"_TP(\d+)", name)
    return int(m.group(1)) if m else 0


def inspect(address: str, match: str = "") -> dict:
    _connect(address)
    import ray

    pgs = [
        {"name": info.get("name", ""), "state": info.get("state"), "id": pg_id}
        for pg_id, info in ray.util.placement_group_table().items()
        if info.get("state") != "REMOVED" and match in info.get("name", "")
    ]
    actors = [
        {"name": a["name"], "namespace": a["namespace"]}
        for a in ray.util.list_named_actors(all_namespaces=True)
        if match in a["name"]
    ]
    return {"placement_groups": pgs, "actors": actors}


def task_records(address: str, match: str = "") -> dict[str, int]:
    """The cluster's task table, as ``ray list tasks`` reads it (the GCS's task events): how
    many records each task name has, for the names that contain ``match``."""
    _connect(address)
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = init_grpc_channel(ray.get_runtime_context().gcs_address)
    try:
        stub = gcs_service_pb2_grpc.TaskInfoGcsServiceStub(channel)
        reply = stub.GetTaskEvents(gcs_service_pb2.GetTaskEventsRequest(limit=100_000), timeout=30)
    finally:
        channel.close()
    names = [e.task_info.name for e in reply.events_by_task if match in e.task_info.name]
    return {n: names.count(n) for n in sorted(set(names))}


def _generation_of(name: str) -> tuple[str, int]:
    """(daemon id, generation) from a worker actor name ``vllm_Worker_<daemon>-g<N>[_TP<r>]``."""
    instance = re.sub(r"(_TP\d+|_PP\d+|_PCP\d+)+$", "", name.removeprefix(WORKER_PREFIX))
    m = re.fullmatch(r"(.*)-g(\d+)", instance)
    return (m.group(1), int(m.group(2))) if m else (instance, 0)


def select(actors: list[dict], match: str = "", standby: bool = False) -> list[dict]:
    """Worker actors by target. With ``match``: every actor whose name contains it. Else
    each daemon's serving engine (its lowest live generation), or with ``standby`` its warm
    standby (the next generation's actors, created before they serve)."""
    actors = [a for a in actors if a["name"].startswith(WORKER_PREFIX) and match in a["name"]]
    if match:
        return actors
    generations: dict[str, set[int]] = {}
    for a in actors:
        daemon, gen = _generation_of(a["name"])
        generations.setdefault(daemon, set()).add(gen)
    chosen = {d: (max(g) if standby else min(g)) for d, g in generations.items() if not standby or len(g) > 1}
    return [a for a in actors if chosen.get(_generation_of(a["name"])[0]) == _generation_of(a["name"])[1]]


def kill_worker(address: str, rank: int | None = None, match: str = "", seed: int | None = None,
                standby: bool = False) -> dict:
    """``ray.kill`` one live worker actor (of the serving engine unless ``match`` or
    ``standby`` says otherwise); returns its name and the kill time (monotonic)."""
    _connect(address)
    import ray

    workers = select(ray.util.list_named_actors(all_namespaces=True), match, standby)
    if rank is not None:
        workers = [a for a in workers if worker_rank(a["name"]) == rank]
    if not workers:
        raise SystemExit(f"no live worker actor matches rank={rank} match={match!r}")
    victim = random.Random(seed).choice(sorted(workers, key=lambda a: a["name"]))
    handle = ray.get_actor(victim["name"], namespace=victim["namespace"])
    killed_at = time.monotonic()
    ray.kill(handle, no_restart=True)
    return {"killed": victim["name"], "rank": worker_rank(victim["name"]), "monotonic": killed_at}


def workers(address: str, match: str = "", standby: bool = False) -> list[dict]:
    """Live vLLM worker actors (as ``select`` picks them): name, rank, pid, node id, actor id
    (from Ray's GCS actor table)."""
    _connect(address)
    from ray._private import state

    out = []
    for actor_id, info in state.actors().items():
        name = info.get("Name", "")
        if info.get("State") == "ALIVE" and name:
            out.append({"name": name, "rank": worker_rank(name), "pid": info.get("Pid"),
                        "node_id": info.get("Address", {}).get("NodeID"), "actor_id": actor_id})
    return sorted(select(out, match, standby), key=lambda w: w["rank"])


def signal_worker(address: str, sig: int, rank: int | None = None, match: str = "", seed: int | None = None,
                  standby: bool = False) -> dict:
    """Send ``sig`` to a worker actor's process (SIGKILL: crash, SIGSTOP: hang). Same host only."""
    found = [w for w in workers(address, match, standby) if rank is None or w["rank"] == rank]
    if not found:
        raise SystemExit(f"no live worker actor matches rank={rank} match={match!r}")
    victim = random.Random(seed).choice(found)
    at = time.monotonic()
    os.kill(victim["pid"], sig)
    return {"signalled": victim["name"], "pid": victim["pid"], "rank": victim["rank"], "signal": int(sig), "monotonic": at}


def kill_all_workers(address: str, match: str = "") -> dict:
    """``ray.kill`` every live worker actor at once. Handles are looked up first: the first
    kill makes vLLM's executor kill the others, and a lookup after that would fail."""
    _connect(address)
    import ray

    handles = []
    for a in select(ray.util.list_named_actors(all_namespaces=True), match):
        try:
            handles.append((a["name"], ray.get_actor(a["name"], namespace=a["namespace"])))
        except ValueError:  # already gone
            pass
    at = time.monotonic()
    for _, handle in handles:
        ray.kill(handle, no_restart=True)
    return {"killed": [name for name, _ in handles], "monotonic": at}


def engine_core_pids(daemon_pid: int) -> list[int]:
    """PIDs of vLLM engine-core processes of the daemon: its children, or the children of its
    engine-core fork server (the warm standby's)."""
    return child_pids({daemon_pid} | set(child_pids({daemon_pid})), b"VLLM::EngineCore")


def signal_local_worker(daemon_pid: int, sig: int, index: int = 0) -> dict:
    """``mp`` executor: signal the ``index``-th worker process of the daemon's engine core."""
    workers = child_pids(set(engine_core_pids(daemon_pid)), b"VLLM::Worker")
    if not workers:
        raise SystemExit(f"no local worker process under the engine core of pid {daemon_pid}")
    pid = workers[index % len(workers)]
    at = time.monotonic()
    os.kill(pid, sig)
    return {"signalled_pid": pid, "signal": int(sig), "monotonic": at}


def kill_engine_core(daemon_pid: int) -> dict:
    pids = engine_core_pids(daemon_pid)
    if not pids:
        raise SystemExit(f"no engine-core child of pid {daemon_pid}")
    at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return {"killed_pids": pids, "monotonic": at}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.inject")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_inspect = sub.add_parser("inspect")
    p_inspect.add_argument("--match", default="")
    p_kill = sub.add_parser("kill-worker")
    p_kill.add_argument("--rank", type=int)
    p_kill.add_argument("--match", default="")
    p_kill.add_argument("--seed", type=int)
    p_kill.add_argument("--standby", action="store_true", help="kill a warm-standby actor instead of a serving one")
    p_sig = sub.add_parser("signal-worker")
    p_sig.add_argument("--signal", required=True, choices=["KILL", "STOP", "CONT", "TERM"])
    p_sig.add_argument("--rank", type=int)
    p_sig.add_argument("--match", default="")
    p_sig.add_argument("--standby", action="store_true", help="signal a warm-standby actor's process")
    p_all = sub.add_parser("kill-all-workers")
    p_all.add_argument("--match", default="")
    p_local = sub.add_parser("signal-local-worker", help="mp executor: signal a worker process of the engine core")
    p_local.add_argument("--daemon-pid", type=int, required=True)
    p_local.add_argument("--signal", required=True, choices=["KILL", "STOP", "CONT", "TERM"])
    p_local.add_argument("--index", type=int, default=0)
    p_core = sub.add_parser("kill-engine-core")
    p_core.add_argument("--daemon-pid", type=int, required=True)
    sub.add_parser("workers").add_argument("--match", default="")
    args = parser.parse_args(argv)
    if args.cmd == "inspect":
        out = inspect(args.address, args.match)
    elif args.cmd == "kill-worker":
        out = kill_worker(args.address, args.rank, args.match, args.seed, args.standby)
    elif args.cmd == "signal-worker":
        out = signal_worker(args.address, getattr(signal, f"SIG{args.signal}"), args.rank, args.match, standby=args.standby)
    elif args.cmd == "kill-all-workers":
        out = kill_all_workers(args.address, args.match)
    elif args.cmd == "workers":
        out = workers(args.address, args.match)
    elif args.cmd == "signal-local-worker":
        out = signal_local_worker(args.daemon_pid, getattr(signal, f"SIG{args.signal}"), args.index)
    else:
        out = kill_engine_core(args.daemon_pid)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
