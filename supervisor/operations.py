"""Operator actions (a part of the owner, ``supervisor.daemon.Supervisor``): the control
socket's commands and SIGHUP reload. Planned rebuilds continue whatever is still in flight on
another engine, so no request is lost: with one replica they drain first and continue the
rest on the new engine; with several, the replicas are rebuilt one after another while the
others serve (their streams move over at once)."""

from __future__ import annotations

import asyncio
from typing import Any

from supervisor import aio, logs
from supervisor.events import EngineFailed
from supervisor.states import State

log = logs.get_logger("vllm_supervisor.operations")


def engine_args_changed(old: Any, new: Any) -> list[str]:
    """The vLLM engine arguments (``EngineArgs`` fields) that differ between two serve Namespaces."""
    from config.engine_args import vllm_engine_arg_names

    names = vllm_engine_arg_names() or set(vars(new))
    return sorted(k for k in names if getattr(old, k, None) != getattr(new, k, None))


class Operations:
    async def _on_control(self, cmd: str, args: dict) -> dict[str, Any]:
        if cmd == "drain":
            if self.state is not State.READY:
                return {"ok": False, "error": f"cannot drain while {self.state.value}"}
            self.machine.transition(State.DRAINING, "operator drain")
            return {"ok": True, "state": self.state.value}
        if cmd == "resume":
            if self.state is not State.DRAINING or self._busy():
                return {"ok": False, "error": f"nothing to resume while {self.state.value}"}
            self.machine.transition(State.READY, "operator resume")
            return {"ok": True, "state": self.state.value}
        if cmd == "restart":
            if self.state not in (State.READY, State.DRAINING) or self._busy():
                return {"ok": False, "error": f"cannot restart while {self.state.value}"}
            self._begin_rebuild("operator", "operator restart")
            return {"ok": True, "state": self.state.value, "generation": self.generation_number}
        if cmd == "kill-worker":
            rank, index = args["rank"], args.get("replica", 0)
            if index >= len(self.replicas):
                return {"ok": False, "error": f"replica {index} out of range ({len(self.replicas)} replica(s))"}
            gen = self.replicas[index].current
            if gen is None or gen.failed or self.state is not State.READY:
                return {"ok": False, "error": f"replica {index} has no serving engine (daemon {self.state.value})"}
            if rank >= self.builder.world_size:
                return {"ok": False, "error": f"rank {rank} out of range (world size {self.builder.world_size})"}
            if self.builder.cluster is None:
                return {"ok": False, "error": "kill-worker needs the ray executor"}
            try:
                killed = await asyncio.to_thread(self.builder.kill_worker, gen.instance_id, rank)
            except Exception as exc:  # the Ray agent gone (cluster lost) or Ray raising
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            return {"ok": bool(killed), "killed": killed, "replica": index, "generation": gen.number,
                    **({} if killed else {"error": "actor not found"})}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    def _busy(self) -> bool:
        """A start, recovery or planned rebuild is under way."""
        return (self._operation is not None and not self._operation.done()) or any(r.busy for r in self.replicas)

    def _on_reload(self) -> None:
        """SIGHUP: re-read the command line's files (the supervisor TOML, vLLM's --config
        YAML) and the environment. Supervision settings and API keys apply at once; engine
        changes by a rebuild behind a drain; an invalid config keeps the old one running
        (shown in ``ctl status``)."""
        if self._reload_settings is None or self.state not in (State.READY, State.DRAINING) or self._busy():
            log.warning("reload ignored: send SIGHUP again once the recovery or rebuild under way has finished"
                        if self._busy() else "reload ignored", state=self.state.value)
            return
        try:
            new, new_args = self._reload_settings()
        except Exception as exc:
            self.config_error = str(exc)
            log.error("reload rejected: keeping the running config", error=self.config_error)
            self.notifier.status(f"{self.state.value}: reload rejected: {self.config_error[:200]}")
            return
        self.config_error = ""
        old, old_args = self.settings, self.engine_args
        self.settings, self.cfg = new, new.supervisor
        for rep in self.replicas:
            rep.intensity.max_restarts, rep.intensity.window_s = self.cfg.max_restarts, self.cfg.restart_window_s
        self.api_keys = [k for k in (new_args.api_key or []) if k]  # read per request: applies at once
        if not new_args.model:  # the demo model: already built
            new_args.model, new_args.served_model_name = old_args.model, old_args.served_model_name
        if (new_args.host, new_args.port) != (old_args.host, old_args.port) or new.ray != old.ray:
            log.warning("--host, --port and ray settings take effect at the next daemon start")
        if new.supervisor.replicas != old.supervisor.replicas:
            log.warning("replicas take effect at the next daemon start", replicas=len(self.replicas))
        if new.supervisor.standby != old.supervisor.standby:
            log.warning("standby takes effect at the next daemon start", standby=self.standby.status()["mode"])
        changed = engine_args_changed(old_args, new_args)
        if new.engine.kv_cache_space_gib != old.engine.kv_cache_space_gib:
            changed.append("kv_cache_space_gib")
        if not changed:
            log.info("config reloaded (no engine change)")
            return
        log.info("config reloaded: engine arguments changed", changed=changed)
        self.engine_args = self.builder.engine_args = new_args
        self.builder.settings = new
        self.builder.config_epoch += 1  # requests go to the new engines once the front takes their config
        self.notifier.reloading()
        self._reloading = self._reattach = True
        self._begin_rebuild("reload", f"config reload: {', '.join(changed)[:150]} changed")

    def _begin_rebuild(self, reason: str, detail: str) -> None:
        """A planned rebuild of every replica. One replica: drain (new requests queue), then
        a recovery that continues whatever is still in flight after ``drain_timeout_s``.
        Several: one replica after another, while the others serve."""
        drain = len(self.replicas) == 1
        if drain and self.state is State.READY:
            self.machine.transition(State.DRAINING, detail)
        targets = [(rep, rep.current) for rep in self.replicas]  # a generation recovered since is not rebuilt again

        async def rebuild() -> None:
            if drain:
                try:
                    await aio.wait_for(self.client.idle.wait(), self.cfg.drain_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("drain deadline passed; continuing the rest on the new engine", in_flight=self.client.in_flight)
                if self.state is not State.DRAINING:
                    return
            for rep, gen in targets:
                # Several replicas: never take down the last one serving (another may be recovering from a fault).
                while not drain and not any(r.serving() for r in self.replicas if r is not rep) and not self.state.terminal:
                    if self.state is State.STOPPING:
                        return
                    self.changed.clear()
                    try:
                        await aio.wait_for(self.changed.wait(), 1.0)
                    except asyncio.TimeoutError:
                        pass
                if (gen is None or gen is not rep.current or gen.failed or rep.busy
                        or self.state not in (State.READY, State.DRAINING, State.RECOVERING)):
                    continue
                gen.failed = gen.planned = True
                self._replica_down(rep, detail)
                gen.interrupt_streams()
                rep.recovery = asyncio.current_task()
                await self._recover(rep, gen, EngineFailed(gen.number, reason, detail))
                rep.recovery = None
            if self._reloading and self.state is State.READY:  # several replicas: READY all along
                self._reloading = False
                self.notifier.ready(f"ready (generation {self.generation_number}): {detail[:200]}")

        self._operation = self._spawn(rebuild())
