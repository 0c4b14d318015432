"""The HTTP front: vLLM's own OpenAI server app over the supervisor's ``EngineClient``.

The app is vLLM's (``build_app`` + ``init_app_state``), so every endpoint and every answer
of ``vllm serve`` is there unchanged. Around it, one small ASGI layer that is ours:

* ``/livez``, ``/readyz`` (``?verbose``), ``/metrics`` (vLLM's ``vllm:*`` series and ours)
  and ``/metrics/supervisor`` (ours alone, promtool-clean) are answered in every state, the
  metrics rendered in a thread of their own (``_RENDER``), not on the event loop;
* until the first engine is up (vLLM's app needs its model config) everything else is a
  503 — the same answer ``/health`` gives whenever no engine serves;
* every 503 carries ``Retry-After`` and closes its connection (``retry_later``); request bodies over ``--max-body-bytes`` get 413;
* API keys (``--api-key``) are checked by vLLM's own middleware, reading the daemon's
  current keys so that a SIGHUP reload rotates them at once.
"""

from __future__ import annotations

import asyncio
import copy
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from supervisor import input_guards, logs
from supervisor.dispatch import Dispatcher, ready
from supervisor.states import State

if TYPE_CHECKING:
    from config import Settings
    from supervisor.engine_client import SupervisedEngineClient

log = logs.get_logger("vllm_supervisor.http")

_OURS = ("/livez", "/readyz", "/metrics", "/metrics/supervisor")

# The metrics are rendered off the event loop, as `vllm serve` renders its /metrics (the
# instrumentator's synchronous endpoint runs in a thread): vLLM's registry and the
# supervisor's take tens of milliseconds to render under load, and on the loop every stream
# would wait that long at each scrape. A thread of its own, so that a scrape never queues
# behind the owner's Ray calls in asyncio's default pool (a cluster loss can hold those).
_RENDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-supervisor-metrics")


def metrics_text(ours: Any, ours_only: bool) -> bytes:
    """The text of ``/metrics`` (vLLM's ``vllm:*`` series, then the supervisor's ``ours``
    registry) or of ``/metrics/supervisor`` (``ours`` alone)."""
    text = generate_latest(ours)
    return text if ours_only else generate_latest(REGISTRY) + text


class Daemon(Dispatcher, Protocol):
    """The daemon as the front sees it: the request path's view, plus the request path itself
    and what the front's own answers read (current keys and settings, so a reload applies at
    once)."""

    @property
    def client(self) -> SupervisedEngineClient: ...

    @property
    def api_keys(self) -> list[str]: ...

    @property
    def engine_args(self) -> Any: ...

    @property
    def settings(self) -> Settings: ...

    def status(self) -> dict[str, Any]: ...


class _Server(uvicorn.Server):
    """Signals belong to the supervisor's owner task, not to uvicorn."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _auth_middleware(sup: Daemon) -> type:
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    class RotatingKeys(AuthenticationMiddleware):
        """vLLM's key check (constant-time, same guarded paths, same 401) over the daemon's
        current keys."""

        def __init__(self, app: Any) -> None:
            self.app = app

        @property
        def api_tokens(self) -> list[bytes]:
            import hashlib

            return [hashlib.sha256(k.encode()).digest() for k in sup.api_keys]

        def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
            if not sup.api_keys:
                return self.app(scope, receive, send)
            return super().__call__(scope, receive, send)

    return RotatingKeys


def retry_later(seconds: bytes) -> list[tuple[bytes, bytes]]:
    """The headers of a 503: ``Retry-After``, and ``Connection: close``. A client that waits
    what ``Retry-After`` says (5 s) and then reuses its keep-alive connection would race the
    server's keep-alive timeout (uvicorn's, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: also 5 s) and
    read "server disconnected" for a request that never arrived; it reconnects instead."""
    return [(b"retry-after", seconds), (b"connection", b"close")]


async def _respond(send: Any, status: int, body: bytes, content_type: str, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Front:
    def __init__(self, sup: Daemon, args: Any):
        self.sup = sup
        self.args = args
        self.app: Any = None
        self.version = 0  # the request path's config_version the app was built on
        self._lifespan: Any = None
        self.server: _Server | None = None
        self.sock: Any = None

    # --- serving --------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the listening socket before anything else starts (as ``vllm serve`` does): a
        port in use is an error at once, not after an engine was built."""
        from vllm.entrypoints.launchers.launcher import create_server_socket, create_server_unix_socket

        a = self.args
        self.sock = create_server_unix_socket(a.uds) if a.uds else create_server_socket((a.host or "", a.port), reuse_port=False)

    async def serve(self) -> None:
        a = self.args
        kwargs: dict[str, Any] = {}
        from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

        log_config = get_uvicorn_log_config(a)
        if log_config is not None:
            kwargs["log_config"] = log_config
        from vllm import envs

        config = uvicorn.Config(
            self, lifespan="off", log_level=a.uvicorn_log_level,
            access_log=not a.disable_uvicorn_access_log, timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            timeout_graceful_shutdown=5,
            ssl_keyfile=a.ssl_keyfile, ssl_certfile=a.ssl_certfile, ssl_ca_certs=a.ssl_ca_certs,
            ssl_cert_reqs=a.ssl_cert_reqs, **({"ssl_ciphers": a.ssl_ciphers} if a.ssl_ciphers else {}), **kwargs)
        # vllm serve's header limits (--h11-max-incomplete-event-size, --h11-max-header-count)
        config.h11_max_incomplete_event_size = a.h11_max_incomplete_event_size
        config.h11_max_header_count = a.h11_max_header_count
        self.server = _Server(config)
        builder = asyncio.create_task(self._build_when_ready())
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            self.sock.close()
            builder.cancel()
            if self._lifespan is not None:
                try:
                    await self._lifespan.__aexit__(None, None, None)
                except Exception:
                    log.exception("vLLM app shutdown raised")

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    @property
    def current(self) -> bool:
        """vLLM's app is built on the request path's current model config."""
        return self.app is not None and self.version == self.sup.client.config_version

    @property
    def ready(self) -> bool:
        """What ``/readyz`` answers: the daemon serves (``supervisor.dispatch.ready``) and vLLM's
        app here is built on the current model config."""
        return ready(self.sup, self.current)

    async def _build_when_ready(self) -> None:
        """vLLM's app, once the first engine gave the request path its model config; built
        again when a reload changed it (requests already running finish on the old one)."""
        sup = self.sup
        while not sup.state.terminal:
            version = sup.client.config_version
            if version == self.version:
                sup.changed.clear()
                await sup.changed.wait()
                continue
            try:
                app, lifespan = await self.build_app()
            except Exception:
                log.exception("could not build vLLM's server app")
                raise
            old, self._lifespan = self._lifespan, lifespan
            self.app, self.version = app, version
            if old is not None:
                await old.__aexit__(None, None, None)

    async def build_app(self) -> tuple[Any, Any]:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.tool_parsers import ToolParserManager

        client = self.sup.client
        args = copy.copy(self.sup.engine_args)
        args.api_key = None  # checked by RotatingKeys over the daemon's current keys
        if args.tool_parser_plugin and len(args.tool_parser_plugin) > 3:
            ToolParserManager.import_tool_parser(args.tool_parser_plugin)
        tasks = await client.get_supported_tasks()
        app = build_app(args, tasks, client.model_config)
        await init_app_state(client, app.state, args, tasks)
        app.state.server = self.server
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        log.info("vLLM server app ready", routes=len(app.routes), tasks=list(tasks))
        return _auth_middleware(self.sup)(app), lifespan

    # --- the ASGI layer -----------------------------------------------------------------

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if self.app is not None:
                return await self.app(scope, receive, send)
            return None
        path = scope["path"]
        if path in _OURS and scope["method"] in ("GET", "HEAD"):
            return await self._ours(path, scope, send)
        bounded = await self._bounded_body(scope, receive, send)
        if bounded is None:
            return None
        receive, body = bounded
        if self.app is None:
            return await self._unavailable(send)
        bad_input = input_guards.check(scope["method"], path, body)
        if bad_input:
            return await _respond(send, 400, input_guards.error_body(bad_input), "application/json")
        retry_after = b"30" if self.sup.state in (State.STOPPING, State.STOPPED, State.FAILED) else b"5"

        async def send_with_retry_after(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                message = {**message, "headers": [*message.get("headers", []), *retry_later(retry_after)]}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)

    async def _bounded_body(self, scope: dict, receive: Any, send: Any) -> tuple[Any, bytes] | None:
        """The request body, read whole up to ``--max-body-bytes`` (else 413 and None), then
        handed on with a ``receive`` whose later calls reach the client (disconnects stay
        visible)."""
        limit = self.sup.settings.server.max_body_bytes  # per request: a reload applies at once
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        too_big = json.dumps({"error": {"message": f"request body larger than {limit} bytes", "type": "BadRequestError",
                                        "param": None, "code": 413}}).encode()
        if length.isdigit() and int(length) > limit:
            await _respond(send, 413, too_big, "application/json")
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks = None
                first = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await _respond(send, 413, too_big, "application/json")
                return None
            if not message.get("more_body"):
                break
        body = b"".join(chunks or [])
        replay = [first] if chunks is None else [{"type": "http.request", "body": body, "more_body": False}]

        async def bounded_receive() -> dict:
            return replay.pop() if replay else await receive()

        return bounded_receive, body

    async def _unavailable(self, send: Any) -> None:
        sup = self.sup
        body = {"error": {"message": f"no engine serving yet: daemon is {sup.state.value} ({sup.reason})",
                          "type": "Service Unavailable", "param": None, "code": 503}}
        await _respond(send, 503, json.dumps(body).encode(), "application/json", retry_later(b"5"))

    async def _ours(self, path: str, scope: dict, send: Any) -> None:
        sup = self.sup
        if path == "/livez":
            body = {"status": "alive", "state": sup.state.value}
            return await _respond(send, 200, json.dumps(body).encode(), "application/json")
        if path == "/readyz":
            body = sup.status()
            if b"verbose" not in scope.get("query_string", b""):
                body = {k: body[k] for k in ("state", "generation", "reason", "in_flight", "recoveries")}
            up = self.ready
            return await _respond(send, 200 if up else 503, json.dumps(body, default=str).encode(),
                                  "application/json", [] if up else retry_later(b"5"))
        body = await asyncio.get_running_loop().run_in_executor(
            _RENDER, metrics_text, sup.metrics.registry, path == "/metrics/supervisor")
        return await _respond(send, 200, body, CONTENT_TYPE_LATEST)
