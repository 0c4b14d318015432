"""``vllm-supervisor`` command line: ``run``, ``check-config`` and ``ctl``.

The config is resolved and validated before Ray or vLLM is imported: an invalid value
prints one line per problem and exits 78 (EX_CONFIG).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, Sequence

from config import EXIT_CONFIG, ConfigError, Settings, load_settings, parse_assignment

# CLI flag -> dotted settings key (the flags a user reaches for most; --set covers the rest).
_FLAGS: dict[str, tuple[str, type]] = {
    "--model": ("engine.model", str),
    "--tensor-parallel-size": ("engine.tensor_parallel_size", int),
    "--pipeline-parallel-size": ("engine.pipeline_parallel_size", int),
    "--max-model-len": ("engine.max_model_len", int),
    "--ray-address": ("ray.address", str),
    "--host": ("server.host", str),
    "--port": ("server.port", int),
    "--data-dir": ("supervisor.data_dir", str),
    "--log-level": ("supervisor.log_level", str),
}


def _add_config_flags(parser: argparse.ArgumentParser, config_positional: bool = False) -> None:
    if config_positional:
        parser.add_argument("config", nargs="?", help="TOML config file")
    else:
        parser.add_argument("--config", "-c", help="TOML config file")
    for flag, (dotted, kind) in _FLAGS.items():
        parser.add_argument(flag, dest=dotted, type=str, default=None, metavar=kind.__name__.upper(), help=f"sets {dotted}")
    parser.add_argument(
        "--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="set any config key (repeatable), e.g. --set engine.extra_args.swap_space=1",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-supervisor", description="Keep a vLLM engine serving through worker failures.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_config_flags(sub.add_parser("run", help="run the daemon"))
    _add_config_flags(sub.add_parser("check-config", help="validate a config and print it resolved"), config_positional=True)
    sub.add_parser("ctl", help="control a running daemon: status|drain|resume|restart|kill-worker (see ctl -h)")
    return parser


def resolve(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    for dotted, _kind in _FLAGS.values():
        value = getattr(args, dotted, None)
        if value is not None:
            overrides[dotted] = parse_assignment(f"{dotted}={value}")[1] if _kind is int else value
    for text in args.assignments:
        dotted, value = parse_assignment(text)
        overrides[dotted] = value
    return load_settings(args.config, overrides)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ctl"]:
        from supervisor.control import main as ctl_main

        return ctl_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        settings = resolve(args)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "check-config":
        print(settings.to_json())
        return 0
    return run(settings, reload_settings=lambda: resolve(args))


def run(settings: Settings, reload_settings=None) -> int:
    from supervisor import logs

    logs.configure(settings.supervisor.log_level, settings.supervisor.log_format)
    return asyncio.run(_serve(settings, reload_settings))


async def _serve(settings: Settings, reload_settings=None) -> int:
    import uvicorn

    from supervisor.control import socket_path
    from supervisor.daemon import Supervisor
    from supervisor.server import UvicornServer, build_app

    control = socket_path(settings.supervisor.control_socket, settings.server.port)
    sup = Supervisor(settings, reload_settings=reload_settings, control_socket=control)
    server = UvicornServer(
        uvicorn.Config(
            build_app(sup),
            host=settings.server.host,
            port=settings.server.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    http = asyncio.create_task(server.serve())
    try:
        code = await sup.run()
    finally:
        server.should_exit = True
        await http
    return code


if __name__ == "__main__":
    sys.exit(main())
