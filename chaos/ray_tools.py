"""Look at and break a running daemon's Ray side from outside, like an operator would.

    python -m chaos.ray_tools --address HOST:PORT inspect [--match SUBSTRING]
    python -m chaos.ray_tools --address HOST:PORT kill-worker [--rank N | --random] [--match SUBSTRING]

``inspect`` prints JSON: live placement groups and named actors (vLLM names its worker
actors ``vllm_Worker_<instance id>[_TP<r>][_PP<r>]``; the daemon's instance id is
``<daemon id>-g<generation>``). ``kill-worker`` calls ``ray.kill`` on one worker actor.
Ray 2.60 clusters use token auth: ``RAY_AUTH_MODE=token`` is set here by default.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

WORKER_PREFIX = "vllm_Worker_"


def _connect(address: str) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")


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


def kill_worker(address: str, rank: int | None = None, match: str = "", seed: int | None = None) -> dict:
    """``ray.kill`` one live worker actor; returns its name and the kill time (monotonic)."""
    _connect(address)
    import ray

    workers = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(WORKER_PREFIX) and match in a["name"]]
    if rank is not None:
        workers = [a for a in workers if worker_rank(a["name"]) == rank]
    if not workers:
        raise SystemExit(f"no live worker actor matches rank={rank} match={match!r}")
    victim = random.Random(seed).choice(sorted(workers, key=lambda a: a["name"]))
    handle = ray.get_actor(victim["name"], namespace=victim["namespace"])
    killed_at = time.monotonic()
    ray.kill(handle, no_restart=True)
    return {"killed": victim["name"], "rank": worker_rank(victim["name"]), "monotonic": killed_at}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.ray_tools")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_inspect = sub.add_parser("inspect")
    p_inspect.add_argument("--match", default="")
    p_kill = sub.add_parser("kill-worker")
    p_kill.add_argument("--rank", type=int)
    p_kill.add_argument("--match", default="")
    p_kill.add_argument("--seed", type=int)
    args = parser.parse_args(argv)
    if args.cmd == "inspect":
        out = inspect(args.address, args.match)
    else:
        out = kill_worker(args.address, args.rank, args.match, args.seed)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
