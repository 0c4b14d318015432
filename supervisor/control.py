"""The control socket: JSON requests over a pyzmq REP socket on a local IPC path (0600).

    vllm-supervisor ctl [--socket PATH] status [--json] | drain | resume | restart | kill-worker RANK [--replica N]
                                         | ray-env

Requests are ``{"cmd": NAME, "args": {...}}``; replies ``{"ok": bool, ...}``. JSON only,
never pickle. The daemon side only validates and enqueues; its owner task acts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import zmq

COMMANDS = ("status", "drain", "resume", "restart", "kill-worker", "ray-env")
# What a Ray client needs to join the daemon's cluster (its private one included): ``ray-env``
# hands them to the daemon's own user (the socket is 0600), as ``export`` lines for a shell.
RAY_CLIENT_ENV = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def ray_client_env() -> dict[str, str]:
    return {k: os.environ[k] for k in RAY_CLIENT_ENV if os.environ.get(k)}


def socket_path(configured: str = "", port: int = 8000, uds: str = "") -> str:
    """Where the daemon listens: the configured path, else ``$RUNTIME_DIRECTORY/control.sock``
    (systemd's RuntimeDirectory=), else ``/tmp/vllm-supervisor-<port>.sock`` (with ``--uds``:
    ``/tmp/vllm-supervisor-uds-<hash of its path>.sock``)."""
    if configured:
        return configured
    if os.environ.get("RUNTIME_DIRECTORY"):
        return str(Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]) / "control.sock")
    return f"/tmp/vllm-supervisor-{uds_key(uds) if uds else port}.sock"


def uds_key(uds: str) -> str:
    """A short name for a daemon that listens on the Unix socket ``uds``."""
    import hashlib

    return f"uds-{hashlib.sha1(uds.encode()).hexdigest()[:10]}"


def socket_answers(path: str) -> bool:
    """Whether a process listens on the Unix socket ``path`` (a stale file refuses)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def parse_request(raw: bytes) -> tuple[str, dict[str, Any]]:
    """Validate one request; raises ValueError with a message for the client."""
    try:
        msg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("request is not JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("cmd"), str):
        raise ValueError('request must be an object with a string "cmd"')
    cmd, args = msg["cmd"], msg.get("args") or {}
    if cmd not in COMMANDS:
        raise ValueError(f"unknown command {cmd!r}; known: {', '.join(COMMANDS)}")
    if not isinstance(args, dict):
        raise ValueError('"args" must be an object')
    if cmd == "kill-worker":
        rank = args.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError("kill-worker needs a non-negative integer rank")
        replica = args.setdefault("replica", 0)
        if not isinstance(replica, int) or isinstance(replica, bool) or replica < 0:
            raise ValueError("kill-worker's replica must be a non-negative integer")
    return cmd, args


async def serve_control(path: str, status: Any, submit: Any) -> None:
    """The daemon side: JSON over a pyzmq REP socket, 0600. ``status()`` (a coroutine) answers
    ``status`` here; every other command goes to ``submit(cmd, args)``, which hands it to the
    owner task and returns its reply."""

    import zmq.asyncio

    from supervisor import aio, logs

    log = logs.get_logger("vllm_supervisor.control")
    if Path(path).exists() and socket_answers(path):
        log.error("control socket in use by another process; not taking it over", path=path)
        return
    sock = zmq.asyncio.Context.instance().socket(zmq.REP)
    Path(path).unlink(missing_ok=True)  # stale: its daemon is gone
    old_umask = os.umask(0o077)
    try:
        sock.bind(f"ipc://{path}")
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    log.info("control socket listening", path=path)
    try:
        while True:
            raw = await sock.recv()
            try:
                cmd, args = parse_request(raw)
                if cmd == "status":
                    reply = {"ok": True, "status": await status()}
                elif cmd == "ray-env":
                    reply = {"ok": True, "env": ray_client_env()}
                else:
                    reply = await aio.wait_for(submit(cmd, args), 60)
            except ValueError as exc:
                reply = {"ok": False, "error": str(exc)}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            await sock.send(json.dumps(reply, default=str).encode())
    finally:
        sock.close(linger=0)
        Path(path).unlink(missing_ok=True)


def request(path: str, cmd: str, args: dict[str, Any] | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"ipc://{path}")
        sock.send(json.dumps({"cmd": cmd, "args": args or {}}).encode())
        return json.loads(sock.recv())
    finally:
        sock.close()


def _table(status: dict[str, Any]) -> str:
    lines = [
        f"state        {status['state']}  ({status['reason']})",
        f"generation   {status['generation']}",
        f"uptime       {status['uptime_s']} s",
        f"in flight    {status['in_flight']} (parked {status['parked']}, queued {status['admission_queue']})",
        f"restarts     {sum(status['restarts'].values())} {status['restarts'] or ''}",
        f"requests     {status['requests'] or {}}",
    ]
    replicas = status.get("replicas") or []
    if len(replicas) > 1:
        lines.append(f"replicas     {sum(r['state'] == 'serving' for r in replicas)}/{len(replicas)} serving")
        for r in replicas:
            lines.append(f"  replica {r['replica']}  {r['state']:<10}  generation {r['generation']}  streams {r['streams']}")
    if status.get("config_error"):
        lines.append(f"config error {status['config_error']}")
    sb = status.get("standby")
    if sb:
        pids = ", ".join(str(w.get("pid") or "-") for w in sb["workers"]) or "-"
        lines.append(f"standby      {sb['mode']}: {sb['state']} for generation {sb['for_generation']} "
                     f"(engine-core fork server pid {sb['forkserver_pid'] or '-'}, worker pids {pids}; "
                     f"replaced {sb['replacements']}, builds adopted/cold {sb['adoptions']['adopted']}/{sb['adoptions']['cold']})"
                     if sb["mode"] != "none" else "standby      none")
    workers = status.get("workers") or []
    if workers:
        lines.append("")
        lines.append(f"{'replica':>7}  {'rank':>4}  {'pid':>8}  {'node':<16}  actor")
        for w in workers:
            lines.append(f"{w.get('replica', 0):>7}  {w['rank']:>4}  {str(w.get('pid') or '-'):>8}  "
                         f"{(w.get('node_id') or '-')[:16]:<16}  {w['name']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="vllm-supervisor ctl")
    parser.add_argument("--socket", default="", help="control socket path (default: derived like the daemon does)")
    parser.add_argument("--port", type=int, default=8000, help="the daemon's HTTP port, to derive the default socket")
    parser.add_argument("--uds", default="", help="the daemon's --uds path, to derive the default socket")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status").add_argument("--json", action="store_true")
    sub.add_parser("drain", help="stop admitting; finish in-flight requests")
    sub.add_parser("resume", help="admit again after a drain")
    sub.add_parser("restart", help="rebuild the engine behind a drain (no request is lost)")
    kill = sub.add_parser("kill-worker", help="drill: ray.kill the worker of RANK (of replica N)")
    kill.add_argument("rank", type=int)
    kill.add_argument("--replica", type=int, default=0)
    sub.add_parser("ray-env", help="export lines that let a Ray client (ray CLI, chaos.inject) join the daemon's "
                                   "cluster: its address, auth mode and token")
    args = parser.parse_args(argv)
    payload = {"rank": args.rank, "replica": args.replica} if args.cmd == "kill-worker" else {}
    path = socket_path(args.socket, args.port, args.uds)
    try:
        reply = request(path, args.cmd, payload)
    except zmq.ZMQError as exc:
        print(f"error: cannot reach the daemon at {path}: {exc}", file=sys.stderr)
        return 2
    if not reply.get("ok"):
        print(f"error: {reply.get('error')}", file=sys.stderr)
        return 1
    if args.cmd == "status" and not args.json:
        print(_table(reply["status"]))
    elif args.cmd == "ray-env":
        import shlex

        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in reply["env"].items()))
    else:
        print(json.dumps(reply, indent=2))
    return 0
