"""``vllm-supervisor`` command line.

    vllm-supervisor serve [MODEL] [any `vllm serve` flag] [supervision flags]
    vllm-supervisor check-config [TOML] [supervision flags]
    vllm-supervisor ctl status|drain|resume|restart|kill-worker RANK [--replica N]|ray-env
    vllm-supervisor assets [systemd-unit|env-file|ray-head-unit|systemd-readme|grafana|alerts] [--path]
    vllm-supervisor run --config TOML [...]     (the pre-0.2 form; same as serve)

``serve`` parses with vLLM's own parser (``make_arg_parser``) plus the supervision group
(``config.serve_args``). The supervision settings are resolved first, before vLLM or Ray is
imported: an invalid value prints one line naming the key and exits 78 (EX_CONFIG).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from typing import Any, Sequence

from config import ConfigError, Settings
from config.exitcodes import EXIT_CONFIG, EXIT_UNAVAILABLE

from config.serve_args import add_supervision_group, load_supervision, vllm_defaults

USAGE = "vllm-supervisor {serve [MODEL] [vllm serve flags] | check-config [TOML] | ctl ... | assets [NAME] | run --config TOML}"

# `run` (the first CLI) -> `serve` spelling
_RUN_FLAGS = {"--config": "--supervisor-config", "-c": "--supervisor-config", "--log-level": "--supervisor-log-level"}


def translate_run(argv: list[str]) -> list[str]:
    """``run --config F --model M --log-level L …`` -> the ``serve`` command line."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag in _RUN_FLAGS:
            arg = _RUN_FLAGS[flag] + (eq + value if eq else "")
        out.append(arg)
    return out


class ServeArgsError(Exception):
    pass


def parse_serve(argv: list[str], settings: Settings | None = None) -> tuple[Settings, argparse.Namespace]:
    """(supervision settings, vLLM's serve Namespace). Raises ``ConfigError`` for a bad
    supervision value (before vLLM is imported) and ``ServeArgsError`` for flags vLLM rejects.
    ``settings``: ``load_supervision(argv)``'s, when the caller has them already."""
    settings = load_supervision(argv) if settings is None else settings
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(demo: bool) -> argparse.Namespace:
        parser = FlexibleArgumentParser(prog="vllm-supervisor serve", usage="vllm-supervisor serve [MODEL] [options]",
                                        description="`vllm serve` under supervision: every vllm serve flag, plus "
                                                    "the supervision group below.")
        parser = make_arg_parser(parser)
        add_supervision_group(parser)
        parser.set_defaults(model="", **vllm_defaults(settings, demo))
        ns = parser.parse_args(argv)
        if ns.model_tag:
            ns.model = ns.model_tag
        return ns

    ns = parse(demo=False)
    if not ns.model:  # the demo model: re-parse so its defaults sit below any flag given
        ns = parse(demo=True)
    if ns.distributed_executor_backend in (None, "ray"):
        ns.distributed_executor_backend = "ray"
    elif ns.distributed_executor_backend != "mp":
        raise ServeArgsError(f"--distributed-executor-backend {ns.distributed_executor_backend}: "
                             "supervised backends are 'ray' (Ray V2 executor) and 'mp'")
    data_parallel_as_replicas(settings, ns)
    from executor.cpu_binding import bound_list_error

    if error := bound_list_error(settings.supervisor.replicas,
                                 (ns.tensor_parallel_size or 1) * (ns.pipeline_parallel_size or 1)):
        raise ServeArgsError(error)
    for flag, dest, bad in (("--api-server-count", "api_server_count", lambda v: v not in (None, 1)),
                            ("--headless", "headless", bool), ("--grpc", "grpc", bool)):
        if bad(getattr(ns, dest, None)):
            raise ServeArgsError(f"{flag}: not supported under supervision (one API server, one engine)")
    try:
        from vllm.entrypoints.launchers.launcher import validate_api_server_args

        validate_parsed_serve_args(ns)
        validate_api_server_args(ns)
    except (TypeError, ValueError, KeyError) as exc:
        raise ServeArgsError(str(exc)) from None
    return settings, ns


# vLLM's data-parallel flags that launch or address ranks across nodes: under supervision the
# replicas' placement groups place the engines (Ray), so these have nothing to say.
DP_LAUNCH_FLAGS = (("--data-parallel-rank", "data_parallel_rank"), ("--data-parallel-start-rank", "data_parallel_start_rank"),
                   ("--data-parallel-address", "data_parallel_address"), ("--data-parallel-rpc-port", "data_parallel_rpc_port"),
                   ("--data-parallel-hybrid-lb", "data_parallel_hybrid_lb"), ("--data-parallel-external-lb", "data_parallel_external_lb"))


def data_parallel_as_replicas(settings: Settings, ns: argparse.Namespace) -> None:
    """``--data-parallel-size N`` on a dense model is N supervised replicas (``--replicas N``):
    vLLM's data parallelism without expert parallelism is N independent engines behind one
    front, which is what replicas are, each restarted on its own. Each replica's engine is
    then built with ``data_parallel_size = 1``. With ``--enable-expert-parallel`` the ranks
    are one engine (each MoE layer's all-to-all spans them all), so one rank's failure stops
    every rank: refused until that is supervised."""
    n = getattr(ns, "data_parallel_size", 1) or 1
    if n == 1:
        return
    if getattr(ns, "enable_expert_parallel", False):
        raise ServeArgsError(f"--data-parallel-size {n} with --enable-expert-parallel: not supported under supervision "
                             "(expert-parallel ranks are coupled: every MoE layer's all-to-all spans them all, so they "
                             "fail and restart together). Without expert parallelism each rank is a replica of its own.")
    for flag, dest in DP_LAUNCH_FLAGS:
        if getattr(ns, dest, None) not in (None, False):
            raise ServeArgsError(f"{flag}: not used under supervision (--data-parallel-size {n} runs {n} supervised "
                                 "replicas, placed by Ray's placement groups on the cluster)")
    local = getattr(ns, "data_parallel_size_local", None)
    if local not in (None, n):
        raise ServeArgsError(f"--data-parallel-size-local {local}: under supervision all {n} replicas are placed by Ray")
    if settings.supervisor.replicas not in (1, n):
        raise ServeArgsError(f"--data-parallel-size {n} and supervisor.replicas = {settings.supervisor.replicas}: "
                             "the same setting twice (data parallelism on a dense model is replicas); give one")
    settings.supervisor.replicas = n
    ns.data_parallel_size, ns.data_parallel_size_local = 1, None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}\n\n  serve         run the daemon (see `serve --help`)\n"
              "  check-config  validate the supervision config and print it resolved\n"
              "  ctl           control a running daemon (see `ctl -h`)\n"
              "  assets        print the systemd unit, its environment file, the Grafana dashboard, the alert rules")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "ctl":
        from supervisor.control import main as ctl_main

        return ctl_main(rest)
    if command == "check-config":
        return _check_config(rest)
    if command == "assets":
        from supervisor.assets import main as assets_main

        return assets_main(rest)
    if command == "run":
        command, rest = "serve", translate_run(rest)
    if command != "serve":
        print(f"unknown command {command!r}; usage: {USAGE}", file=sys.stderr)
        return 2
    from supervisor.children import forget_signals_in_forks, prefer_spawn

    prefer_spawn()  # before anything imports vLLM, as `vllm serve` does
    forget_signals_in_forks()
    agent = None
    try:
        settings = load_supervision(rest)
        from supervisor import logs

        # the log format before the first line (early_agent may warn); run() sets it again from the parsed flags
        logs.configure(settings.supervisor.log_level, settings.supervisor.log_format)
        # the first Ray agent's process (no Ray yet), so that its import of vLLM runs beside ours
        from supervisor.raylink import early_agent

        agent = early_agent(settings, rest)
        settings, ns = parse_serve(rest, settings)
    except (ConfigError, ServeArgsError) as exc:
        _kill(agent)  # before the message: nothing of ours outlives the exit
        print(str(exc) if isinstance(exc, ConfigError) else f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except BaseException:  # a help page's exit, an interrupt
        _kill(agent)
        raise
    return run(settings, ns, reload=lambda: parse_serve(rest), early_agent=agent)


def _kill(agent: Any) -> None:
    if agent is not None:
        agent.kill()


def _check_config(argv: list[str]) -> int:
    from config import load_settings
    from config.serve_args import supervision_overrides

    parser = argparse.ArgumentParser(prog="vllm-supervisor check-config")
    parser.add_argument("config", nargs="?", help="supervisor TOML file")
    add_supervision_group(parser)
    parser.add_argument("--host", help="server.host")
    parser.add_argument("--port", help="server.port")
    ns = parser.parse_args(argv)
    overrides = supervision_overrides(ns)
    overrides.update({k: v for k, v in (("server.host", ns.host), ("server.port", ns.port)) if v is not None})
    try:
        settings = load_settings(ns.config or getattr(ns, "supervisor_config", None), overrides)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    print(settings.to_json())
    return 0


def run(settings: Settings, engine_args: Any, reload: Any = None, early_agent: Any = None) -> int:
    import uvloop

    from supervisor import logs

    logs.configure(settings.supervisor.log_level, settings.supervisor.log_format)
    # uvloop, as `vllm serve` runs its server: the standard loop's Python transports cost the
    # request path about twice the CPU per streamed token (bench.profile, docs/benchmarks.md)
    return uvloop.run(_serve(settings, engine_args, reload, early_agent))


async def _serve(settings: Settings, engine_args: Any, reload: Any = None, early_agent: Any = None) -> int:
    serving, sup = False, None
    try:  # until the daemon runs, any way out kills the early Ray agent (the first connect takes it)
        from supervisor.control import socket_answers, socket_path
        from supervisor.daemon import Supervisor
        from supervisor.http import Front

        control = socket_path(settings.supervisor.control_socket, engine_args.port, engine_args.uds or "")
        sup = Supervisor(settings, engine_args, reload_settings=reload, control_socket=control, early_agent=early_agent)
        # vLLM's ZeroMQ sockets (the engine core's and its workers', named by uuid, in /tmp by
        # default) in the daemon's runtime directory, which its stop removes and the reaper after
        # a crash: `vllm serve` on Ray V2 leaves 7 of them in /tmp at every start
        os.environ.setdefault("VLLM_RPC_BASE_PATH", str(sup.runtime_dir))
        front = Front(sup, engine_args)
        try:
            front.bind()
        except OSError as exc:
            print(f"error: cannot listen on {engine_args.uds or f'{engine_args.host}:{engine_args.port}'}: {exc}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        if socket_answers(control):
            print(f"error: another daemon answers on the control socket {control} (set --control-socket)", file=sys.stderr)
            return EXIT_UNAVAILABLE
        record = _crash_only_start(settings, engine_args, sup, control)
        serving = True
    finally:
        if not serving:  # the agent is still unconnected (RayLink holds it, or dropped it): a kill is idempotent
            _kill(early_agent)
            for made in sup.own_dirs() if sup is not None else ():  # its stop would have removed them
                shutil.rmtree(made, ignore_errors=True)
    http = asyncio.create_task(front.serve())
    try:
        code = await sup.run()
    finally:
        await front.stop()
        await http
    record.close_clean()  # not reached when the daemon crashes: the reaper cleans then
    return code


def _crash_only_start(settings: Settings, engine_args: Any, sup: Any, control: str) -> Any:
    """Clean what a crashed predecessor on this port left, start our reaper, write our record
    (``supervisor/crashrecord.py``)."""
    from supervisor import crashrecord, logs
    from supervisor.control import uds_key

    key = uds_key(engine_args.uds) if engine_args.uds else f"{engine_args.host or 'any'}-{engine_args.port}"
    record = crashrecord.RunRecord(crashrecord.record_path(settings.supervisor.data_dir, key), sup.own_dirs())
    pred = crashrecord.read_predecessor(record.path)
    if pred is not None:
        cleaned = crashrecord.clean_local(pred, record.path)
        same_cluster = bool(pred.ray_address) and pred.ray_address == settings.ray.address
        sup.ray.predecessor_id = pred.daemon_id if same_cluster else ""
        logs.get_logger("vllm_supervisor.cli").warning(
            "the previous daemon on this port did not stop cleanly: cleaned what it left",
            predecessor_pid=pred.pid, predecessor_id=pred.daemon_id, **cleaned,
            ray_leftovers="removed after Ray connects" if same_cluster else "none (its private cluster went with it)")
    record.start_reaper(control)
    try:
        record.write(sup.daemon_id, settings.ray.address, control)
    except OSError as exc:  # e.g. a read-only data_dir with a real model: the reaper still runs
        logs.get_logger("vllm_supervisor.cli").warning(
            "cannot write the run record: a crash will not be cleaned by the next start", path=str(record.path), error=str(exc))
    return record


if __name__ == "__main__":
    sys.exit(main())
