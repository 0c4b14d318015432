"""On a CPU host with replicas: each replica's lone worker is bound to cores as ``vllm serve
--data-parallel-size N`` binds each data-parallel rank's, and a warm standby made for one
replica can be bound again to serve another.

vLLM's ``mp`` executor starts each engine's workers with OpenMP settings computed by its
``OMPProcessManager`` from ``VLLM_CPU_OMP_THREADS_BIND``:

* ``auto`` (the default): the cores of a NUMA node per local rank, less those it reserves for the
  engine cores and the front;
* a list of cores per rank, ``|``-separated (``0-3|4-7``): under data parallelism rank *d* takes
  the *d*-th slice of ``world_size`` entries;
* ``nobind``: none.

Ray starts a worker with an OpenMP thread per core of the host, unbound: with several engines
their pools oversubscribe the cores and spin beside the engine cores (two replicas on 2 cores:
the chat benchmark took 30–32 s unbound, 13 s bound). So with replicas the daemon puts vLLM's
own settings in each worker's runtime environment (``cpu_binding``). vLLM reads each replica,
an engine of data-parallel size 1, as rank 0, and bound every replica's worker to the first
entry of a ``|`` list; so vLLM is handed the replica's slice of the list, as it slices one per
rank (``replica_slice``), here and in each replica's engine core on the ``mp`` executor. One list
without ``|`` binds every replica's worker to those cores (``vllm serve`` would refuse it for a
second rank). One engine keeps Ray's pool, as ``vllm serve --distributed-executor-backend ray``
runs it (bound, it lost about a fifth of its capacity on 2 cores, docs/benchmarks.md).

The warm standby is shared by the replicas and made with the binding of the replica that came
up last; a runtime environment takes effect when the process starts. When the adopting
replica's binding differs only in its cores (the same variables, as many cores: what a ``|``
list gives), the standby is bound again at adoption instead of refused (``rebind``): every
thread bound within the old cores moves to the matching new ones, position for position, as
the OpenMP runtime would have bound it; vLLM binds the worker's memory to the node of its first
core later, in its ``__init__``. Anything else that differs refuses the standby, as before.

With ``auto`` on a host of several NUMA nodes every replica takes the first node's cores, as
every data-parallel rank of ``vllm serve`` does in this vLLM: its auto binding picks the node of
the local rank among the visible ones (``CPU_VISIBLE_MEMORY_NODES``), which nothing narrows per
rank (read in vLLM's source; this machine has one node). A list per replica places them. An engine of several workers (TP or PP > 1) on Ray is not bound:
vLLM binds each rank of a node to a NUMA node of its own and gives up where there are fewer,
and Ray gives all of an engine's workers one runtime env.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.platforms import current_platform

from executor.events import wiring

logger = logging.getLogger("vllm.supervisor.executor")

BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
# What vLLM's OMPProcessManager.configure_omp_envs sets, for each OpenMP runtime it knows.
BINDING_KEYS = frozenset({"OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY",
                          "KMP_AFFINITY", "KMP_BLOCKTIME", "KMP_TPAUSE"})
_CORE_KEYS = ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")  # the one that names the cores


def cpu_binding(vllm_config: Any) -> dict[str, str]:
    """The OpenMP variables vLLM's ``mp`` executor would start this engine's lone worker with,
    were the engine the replica's rank of ``vllm serve --data-parallel-size N``. Read where
    vLLM's executor reads it (the engine core; the daemon for a standby), from that host's
    cores. Empty on a GPU host, with one replica, with ``nobind``, and for an engine of more than
    one worker; empty with a warning where vLLM refuses the settings."""
    if (not current_platform.is_cpu() or vllm_config.parallel_config.world_size != 1
            or int(wiring(vllm_config).get("replicas") or 1) < 2):
        return {}
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    try:
        with replica_slice(vllm_config):  # vLLM reads every replica as data-parallel rank 0
            manager = OMPProcessManager(vllm_config)
        before = dict(os.environ)
        with manager.configure_omp_envs(rank=0, local_rank=0):
            return {k: v for k, v in os.environ.items() if before.get(k) != v}
    except (AssertionError, RuntimeError, ValueError, IndexError) as exc:  # vLLM's own refusals
        logger.warning("workers start without vLLM's OpenMP binding: %s", exc)
        return {}


def replica_entries(vllm_config: Any) -> str | None:
    """This replica's slice of a ``|`` list in ``VLLM_CPU_OMP_THREADS_BIND`` (``world_size``
    entries, from the replica's index, as vLLM slices one per data-parallel rank); None without
    replicas or such a list."""
    value = os.environ.get(BIND_VAR, "")
    info = wiring(vllm_config)
    if "|" not in value or int(info.get("replicas") or 1) < 2:
        return None
    size = vllm_config.parallel_config.world_size
    first = int(info.get("replica") or 0) * size
    return "|".join(value.split("|")[first:first + size])


@contextmanager
def replica_slice(vllm_config: Any) -> Iterator[None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` is the replica's slice meanwhile: for ``cpu_binding`` (the
    daemon; a Ray V2 engine core), and for vLLM's ``mp`` executor while it starts its workers in a
    replica's engine core. vLLM's ``OMPProcessManager`` reads it there, before vLLM caches its
    variables (at the end of the engine core's start)."""
    entries = replica_entries(vllm_config)
    if entries is None:
        yield
        return
    saved = os.environ[BIND_VAR]
    os.environ[BIND_VAR] = entries
    try:
        yield
    finally:
        os.environ[BIND_VAR] = saved


def bound_list_error(replicas: int, world_size: int, value: str | None = None) -> str:
    """Why ``VLLM_CPU_OMP_THREADS_BIND`` cannot bind ``replicas`` engines of ``world_size``
    workers each ("" when it can): a ``|`` list needs an entry per worker of every replica, as
    ``vllm serve`` needs one per worker of every data-parallel rank."""
    value = os.environ.get(BIND_VAR, "") if value is None else value
    if replicas < 2 or "|" not in value or not current_platform.is_cpu():
        return ""
    entries = value.split("|")
    if len(entries) == replicas * world_size and all(e.strip() for e in entries):
        return ""
    return (f"{BIND_VAR}={value!r} lists {len(entries)} sets of cores; --data-parallel-size {replicas} needs "
            f"{replicas * world_size}, one per replica (or one list without '|' for all of them)")


def cores_of(env: dict[str, str]) -> list[int]:
    """The cores, in order, that vLLM's OpenMP variables ``env`` bind to (empty: none)."""
    for key in _CORE_KEYS:
        value = env.get(key)
        if value:
            if key == "KMP_AFFINITY":
                value = value.partition("proclist=")[2]
            return [int(c) for c in re.findall(r"\d+", value)]
    return []


def rebinding(standby_env: dict[str, str], worker_env: dict[str, str]) -> dict[str, str] | None:
    """Of two runtime environments' variables, the binding a standby created with ``standby_env``
    takes at adoption to stand for a worker created with ``worker_env``: {} when they bind alike,
    the worker's binding variables when only the cores differ and as many of them, None when the
    binding cannot be changed in a running process (another runtime, another thread count)."""
    ours = {k: v for k, v in standby_env.items() if k in BINDING_KEYS}
    theirs = {k: v for k, v in worker_env.items() if k in BINDING_KEYS}
    if ours == theirs:
        return {}
    if set(ours) != set(theirs) or ours.get("OMP_NUM_THREADS") != theirs.get("OMP_NUM_THREADS"):
        return None
    if any(ours[k] != theirs[k] for k in ours if k not in _CORE_KEYS):
        return None
    old, new = cores_of(ours), cores_of(theirs)
    if not old or len(old) != len(new):
        return None
    return theirs


def rebind(old_env: dict[str, str], new_env: dict[str, str]) -> int:
    """In this process: bind every thread bound within ``old_env``'s cores to the matching cores of
    ``new_env`` (position for position) and set ``new_env``'s variables. Returns the threads moved."""
    mapping = dict(zip(cores_of(old_env), cores_of(new_env)))
    torch = sys.modules.get("torch")
    if torch is not None and int(old_env.get("OMP_NUM_THREADS") or 1) > 1:
        # The OpenMP pool exists before it is moved: a pool thread created later would be bound by
        # the runtime to the places it read when it started (the old cores).
        torch.zeros(1 << 22).add_(1)
    moved = 0
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            allowed = os.sched_getaffinity(tid)
            if allowed and allowed <= mapping.keys():
                os.sched_setaffinity(tid, {mapping[c] for c in allowed})
                moved += 1
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
    os.environ.update(new_env)
    return moved
