"""Operator actions (a part the owner, ``supervisor.daemon.Supervisor``, builds; its task runs
every method here): the control socket's commands and SIGHUP reload. Planned rebuilds continue whatever is still in flight on
another engine, so no request is lost: with one replica they drain first and continue the
rest on the new engine; with several, the replicas are rebuilt one after another while the
others serve (their streams move over at once)."""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor import aio, logs
from supervisor.events import EngineFailed
from supervisor.owner import Owner
from supervisor.states import State

log = logs.get_logger("vllm_supervisor.operations")


def engine_args_changed(old: Any, new: Any) -> list[str]:
    """The vLLM engine arguments (``EngineArgs`` fields) that differ between two serve Namespaces."""
    from config.engine_args import vllm_engine_arg_names

    names = vllm_engine_arg_names() or set(vars(new))
    return sorted(k for k in names if getattr(old, k, None) != getattr(new, k, None))


class Operations:
    def __init__(self, sup: Owner, engine_args: Any, reload_settings: Any = None):
        self.sup = sup
        self.engine_args = engine_args  # the serve Namespace running now
        self._reload_settings = reload_settings  # () -> (Settings, Namespace); raises ConfigError
        self.api_keys: list[str] = [k for k in (getattr(engine_args, "api_key", None) or []) if k]
        self.config_error = ""  # why the last reload was rejected
        self.reloading = False  # a reload's rebuild is under way: READY=1 again once it serves
        self.operation: asyncio.Task | None = None  # the start, or a planned rebuild

    async def on_control(self, cmd: str, args: dict) -> dict[str, Any]:
        sup = self.sup
        if cmd == "drain":
            if sup.state is not State.READY:
                return {"ok": False, "error": f"cannot drain while {sup.state.value}"}
            sup.machine.transition(State.DRAINING, "operator drain")
            return {"ok": True, "state": sup.state.value}
        if cmd == "resume":
            if sup.state is not State.DRAINING or self.busy():
                return {"ok": False, "error": f"nothing to resume while {sup.state.value}"}
            sup.machine.transition(State.READY, "operator resume")
            return {"ok": True, "state": sup.state.value}
        if cmd == "restart":
            if sup.state not in (State.READY, State.DRAINING) or self.busy():
                return {"ok": False, "error": f"cannot restart while {sup.state.value}"}
            self.begin_rebuild("operator", "operator restart")
            return {"ok": True, "state": sup.state.value, "generation": sup.generation_number}
        if cmd == "kill-worker":
            rank, index = args["rank"], args.get("replica", 0)
            if index >= len(sup.replicas):
                return {"ok": False, "error": f"replica {index} out of range ({len(sup.replicas)} replica(s))"}
            gen = sup.replicas[index].current
            if gen is None or gen.failed or sup.state is not State.READY:
                return {"ok": False, "error": f"replica {index} has no serving engine (daemon {sup.state.value})"}
            if rank >= sup.builder.world_size:
                return {"ok": False, "error": f"rank {rank} out of range (world size {sup.builder.world_size})"}
            if sup.ray.cluster is None:
                return {"ok": False, "error": "kill-worker needs the ray executor"}
            try:
                killed = await asyncio.to_thread(sup.ray.kill_worker, gen.instance_id, rank)
            except Exception as exc:  # the Ray agent gone (cluster lost) or Ray raising
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            return {"ok": bool(killed), "killed": killed, "replica": index, "generation": gen.number,
                    **({} if killed else {"error": "actor not found"})}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def busy(self) -> bool:
        """A start, recovery or planned rebuild is under way."""
        sup = self.sup
        return (self.operation is not None and not self.operation.done()) or any(r.busy for r in sup.replicas)

    def on_reload(self) -> None:
        """SIGHUP: re-read the command line's files (the supervisor TOML, vLLM's --config
        YAML) and the environment. Supervision settings and API keys apply at once; engine
        changes by a rebuild behind a drain; an invalid config keeps the old one running
        (shown in ``ctl status``)."""
        sup = self.sup
        if self._reload_settings is None or sup.state not in (State.READY, State.DRAINING) or self.busy():
            log.warning("reload ignored: send SIGHUP again once the recovery or rebuild under way has finished"
                        if self.busy() else "reload ignored", state=sup.state.value)
            return
        try:
            new, new_args = self._reload_settings()
        except Exception as exc:
            self.config_error = str(exc)
            log.error("reload rejected: keeping the running config", error=self.config_error)
            sup.notifier.status(f"{sup.state.value}: reload rejected: {self.config_error[:200]}")
            return
        self.config_error = ""
        old, old_args = sup.settings, self.engine_args
        sup.settings, sup.cfg = new, new.supervisor
        for rep in sup.replicas:
            rep.intensity.max_restarts, rep.intensity.window_s = sup.cfg.max_restarts, sup.cfg.restart_window_s
        self.api_keys = [k for k in (new_args.api_key or []) if k]  # read per request: applies at once
        if not new_args.model:  # the demo model: already built
            new_args.model, new_args.served_model_name = old_args.model, old_args.served_model_name
        if (new_args.host, new_args.port) != (old_args.host, old_args.port) or new.ray != old.ray:
            log.warning("--host, --port and ray settings take effect at the next daemon start")
        if new.supervisor.replicas != old.supervisor.replicas:
            log.warning("replicas take effect at the next daemon start", replicas=len(sup.replicas))
        if new.supervisor.standby != old.supervisor.standby:
            log.warning("standby takes effect at the next daemon start", standby=sup.standby.status()["mode"])
        changed = engine_args_changed(old_args, new_args)
        if new.engine.kv_cache_space_gib != old.engine.kv_cache_space_gib:
            changed.append("kv_cache_space_gib")
        if not changed:
            log.info("config reloaded (no engine change)")
            return
        log.info("config reloaded: engine arguments changed", changed=changed)
        self.engine_args = sup.builder.engine_args = new_args
        sup.builder.settings = new
        sup.builder.config_epoch += 1  # requests go to the new engines once the front takes their config
        sup.notifier.reloading()
        self.reloading = sup.recovery.reattach = True
        self.begin_rebuild("reload", f"config reload: {', '.join(changed)[:150]} changed")

    def begin_rebuild(self, reason: str, detail: str) -> None:
        """A planned rebuild of every replica. One replica: drain (new requests queue), then
        a recovery that continues whatever is still in flight after ``drain_timeout_s``.
        Several: one replica after another, while the others serve."""
        sup = self.sup
        drain = len(sup.replicas) == 1
        if drain and sup.state is State.READY:
            sup.machine.transition(State.DRAINING, detail)
        targets = [(rep, rep.current) for rep in sup.replicas]  # a generation recovered since is not rebuilt again

        async def rebuild() -> None:
            if drain:
                try:
                    await aio.wait_for(sup.client.idle.wait(), sup.cfg.drain_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("drain deadline passed; continuing the rest on the new engine", in_flight=sup.client.in_flight)
                if sup.state is not State.DRAINING:
                    return
            for rep, gen in targets:
                # Several replicas: never take down the last one serving (another may be recovering from a fault).
                while not drain and not any(r.serving() for r in sup.replicas if r is not rep) and not sup.state.terminal:
                    if sup.state is State.STOPPING:
                        return
                    sup.changed.clear()
                    try:
                        await aio.wait_for(sup.changed.wait(), 1.0)
                    except asyncio.TimeoutError:
                        pass
                if (gen is None or gen is not rep.current or gen.failed or rep.busy
                        or sup.state not in (State.READY, State.DRAINING, State.RECOVERING)):
                    continue
                gen.failed = gen.planned = True
                sup.recovery.replica_down(rep, detail)
                gen.interrupt_streams()
                rep.recovery = asyncio.current_task()
                await sup.recovery.recover(rep, gen, EngineFailed(gen.number, reason, detail))
                rep.recovery = None
            if self.reloading and sup.state is State.READY:  # several replicas: READY all along
                self.reloading = False
                sup.notifier.ready(f"ready (generation {sup.generation_number}): {detail[:200]}")

        self.operation = sup.spawn(rebuild())
