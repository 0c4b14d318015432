"""Operator actions' own work: a SIGHUP reload's plan, and the control socket's
``kill-worker``. The owner's dispatch (``supervisor.owner``) decides and applies: it drains,
resumes, and starts planned rebuilds itself, and applies a reload plan.

Planned rebuilds continue whatever is still in flight on another engine, so no request is
lost: with one replica they drain first and continue the rest on the new engine; with
several, the replicas are rebuilt one after another while the others serve (their streams
move over at once)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from config import Settings
from supervisor import logs
from supervisor.raylink import RayLink

log = logs.get_logger("vllm_supervisor.operations")


def engine_args_changed(old: Any, new: Any) -> list[str]:
    """The vLLM engine arguments (``EngineArgs`` fields) that differ between two serve Namespaces."""
    from config.engine_args import vllm_engine_arg_names

    names = vllm_engine_arg_names() or set(vars(new))
    return sorted(k for k in names if getattr(old, k, None) != getattr(new, k, None))


@dataclass(frozen=True)
class ReloadPlan:
    """What a reload changes; the owner applies it. ``changed``: the engine arguments that
    differ (empty: supervision settings and API keys only, applied at once)."""

    settings: Settings
    engine_args: Any  # vLLM's serve Namespace
    api_keys: list[str]
    changed: list[str]


def plan_reload(reload_settings: Callable[[], tuple[Settings, Any]], old: Settings, old_args: Any) -> ReloadPlan:
    """Re-read the command line's files (the supervisor TOML, vLLM's --config YAML) and the
    environment; raises ``ConfigError`` when they are invalid (the old config keeps running)."""
    new, new_args = reload_settings()
    if not new_args.model:  # the demo model: already built
        new_args.model, new_args.served_model_name = old_args.model, old_args.served_model_name
    if (new_args.host, new_args.port) != (old_args.host, old_args.port) or new.ray != old.ray:
        log.warning("--host, --port and ray settings take effect at the next daemon start")
    if new.supervisor.replicas != old.supervisor.replicas:
        log.warning("replicas take effect at the next daemon start", replicas=old.supervisor.replicas)
    if new.supervisor.standby != old.supervisor.standby:
        log.warning("standby takes effect at the next daemon start", standby=old.supervisor.standby)
    if new.supervisor.standby_kv != old.supervisor.standby_kv:
        log.warning("standby_kv takes effect at the next daemon start", standby_kv=old.supervisor.standby_kv)
    changed = engine_args_changed(old_args, new_args)
    if new.engine.kv_cache_space_gib != old.engine.kv_cache_space_gib:
        changed.append("kv_cache_space_gib")
    return ReloadPlan(new, new_args, [k for k in (new_args.api_key or []) if k], changed)


async def kill_worker(ray: RayLink, instance_id: str, rank: int, replica: int, generation: int,
                      reply: asyncio.Future) -> None:
    """``ctl kill-worker``: kill the worker actor of ``rank`` (the owner checked the rest)."""
    try:
        killed = await asyncio.to_thread(ray.kill_worker, instance_id, rank)
        answer = {"ok": bool(killed), "killed": killed, "replica": replica, "generation": generation,
                  **({} if killed else {"error": "actor not found"})}
    except Exception as exc:  # the Ray agent gone (cluster lost) or Ray raising
        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    if not reply.done():
        reply.set_result(answer)
