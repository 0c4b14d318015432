"""The HTTP front: OpenAI-compatible completions, chat and models, plus health endpoints.

Requests are parsed and answered with vLLM's own OpenAI protocol models; prompts are
tokenized here (chat through the tokenizer's chat template) and generation goes
through ``Supervisor.generate``. Errors are OpenAI-style bodies with a 4xx status;
the daemon never answers a malformed request with a 500.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.serve.engine.protocol import (
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RequestOutputKind

from supervisor import logs
from supervisor.daemon import EngineUnavailable, RequestFailed, Supervisor

log = logs.get_logger("vllm_supervisor.http")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.type = type_
        self.param = param
        self.headers = headers or {}


def error_response(status: int, message: str, type_: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _sse(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_unset=False, exclude_none=True)}\n\n"


class UvicornServer(uvicorn.Server):
    """Signals belong to the supervisor's owner task, not to uvicorn."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_app(sup: Supervisor) -> FastAPI:
    app = FastAPI(title="vllm-supervisor", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.type, exc.param, exc.headers)

    async def read_json(request: Request) -> dict[str, Any]:
        max_body = sup.settings.server.max_body_bytes  # per request: a reload applies at once
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            raise ApiError(413, f"request body larger than {max_body} bytes")
        body = await request.body()
        if len(body) > max_body:
            raise ApiError(413, f"request body larger than {max_body} bytes")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    def parse(model_cls: Any, data: dict[str, Any]) -> Any:
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(400, f"{where}: {first['msg']}", param=where or None) from None
        except Exception as exc:  # vLLM's own validators raise VLLMValidationError (not a ValueError)
            raise ApiError(400, str(exc), param=getattr(exc, "parameter", None)) from None

    def sampling_params(build: Any) -> Any:
        """``req.to_sampling_params(...)``: vLLM validates the values here (``temperature: -1``,
        ``top_p: 2``, …); a rejected value is the client's error, named."""
        try:
            return build()
        except ApiError:
            raise
        except Exception as exc:
            param = getattr(exc, "parameter", None)
            raise ApiError(400, f"{param + ': ' if param else ''}{exc}", param=param) from None

    def check_auth(request: Request) -> None:
        key = sup.settings.server.api_key
        if key and request.headers.get("authorization", "") != f"Bearer {key}":
            raise ApiError(401, "missing or invalid API key", type_="authentication_error")

    def check_model(name: str | None) -> None:
        if name and name != sup.served_model_name:
            raise ApiError(404, f"model {name!r} does not exist; this daemon serves {sup.served_model_name!r}", type_="not_found_error", param="model")

    def budget(prompt_len: int, requested: int | None) -> int:
        limit = sup.settings.engine.max_model_len
        room = limit - prompt_len
        if room <= 0:
            raise ApiError(400, f"prompt has {prompt_len} tokens; the model's context is {limit}", param="prompt")
        if requested is None:
            return room
        if requested < 1:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        if requested > room:
            raise ApiError(400, f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds the model's context of {limit}", param="max_tokens")
        return requested

    def unsupported(req: Any) -> None:
        if getattr(req, "n", 1) != 1:
            raise ApiError(400, "n > 1 is not supported", param="n")
        if getattr(req, "use_beam_search", False):
            raise ApiError(400, "beam search is not supported", param="use_beam_search")
        if getattr(req, "echo", False):
            raise ApiError(400, "echo is not supported", param="echo")
        if getattr(req, "suffix", None):
            raise ApiError(400, "suffix is not supported", param="suffix")
        if getattr(req, "logprobs", None) not in (None, False) or getattr(req, "prompt_logprobs", None):
            raise ApiError(400, "logprobs are not supported", param="logprobs")

    def need_ready() -> None:
        if sup.tokenizer is None:
            raise EngineUnavailable(f"daemon is {sup.state.value}: {sup.machine.reason}")

    async def stream_outputs(prompt_ids: list[int], params: Any, request_id: str) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """(text delta, token ids delta, finish reason) per engine step."""
        try:
            async for out in sup.generate(prompt_ids, params, request_id):
                c = out.outputs[0]
                yield c.text, list(c.token_ids), c.finish_reason
        except VLLMClientError as exc:  # the engine rejected the request's input
            raise ApiError(400, str(exc), param=getattr(exc, "parameter", None)) from None

    async def first_then_rest(gen: AsyncIterator[Any]) -> tuple[Any, AsyncIterator[Any]]:
        """Pull the first item now so that 'no engine' errors become a proper status."""
        first = await gen.__anext__()

        async def rest() -> AsyncIterator[Any]:
            yield first
            async for item in gen:
                yield item

        return first, rest()

    # --- OpenAI endpoints -------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_auth(request)
        need_ready()
        card = ModelCard(id=sup.served_model_name, root=sup.model_path, max_model_len=sup.settings.engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        req = parse(CompletionRequest, await read_json(request))
        check_model(req.model)
        unsupported(req)
        need_ready()
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = sup.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise ApiError(400, "prompt must be one string or one list of token ids", param="prompt")
        max_tokens = budget(len(prompt_ids), req.max_tokens)
        params = sampling_params(lambda: req.to_sampling_params(max_tokens))
        params.output_kind = RequestOutputKind.DELTA
        request_id = f"cmpl-{uuid.uuid4().hex}"
        model = sup.served_model_name
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want_ids = bool(req.return_token_ids)
        log.info("request", request_id=request_id, prompt_tokens=len(prompt_ids), max_tokens=max_tokens, stream=bool(req.stream))
        first, outputs = await first_then_rest(stream_outputs(prompt_ids, params, request_id))

        if req.stream:
            async def events() -> AsyncIterator[str]:
                n = 0
                try:
                    async for text, ids, finish in outputs:
                        n += len(ids)
                        choice = CompletionResponseStreamChoice(index=0, text=text, finish_reason=finish, token_ids=ids if want_ids else None)
                        yield _sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))
                    if include_usage:
                        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n)
                        yield _sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
                except (EngineUnavailable, RequestFailed) as exc:
                    yield f"data: {json.dumps(_stream_error(exc))}\n\n"
                yield "data: [DONE]\n\n"
                log.info("request done", request_id=request_id, completion_tokens=n)

            return StreamingResponse(events(), media_type="text/event-stream")

        text, ids, finish = "", [], None
        async for t, i, f in outputs:
            text, finish = text + t, f or finish
            ids += i
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=len(ids), total_tokens=len(prompt_ids) + len(ids))
        choice = CompletionResponseChoice(index=0, text=text, finish_reason=finish, token_ids=ids if want_ids else None)
        log.info("request done", request_id=request_id, completion_tokens=len(ids))
        return JSONResponse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice], usage=usage).model_dump(exclude_none=True))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        check_auth(request)
        req = parse(ChatCompletionRequest, await read_json(request))
        check_model(req.model)
        unsupported(req)
        if req.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        need_ready()
        messages = [_plain_message(m) for m in req.messages]
        try:
            prompt_text = sup.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt)
        except Exception as exc:  # a template error is the request's fault
            raise ApiError(400, f"messages could not be rendered with the chat template: {exc}", param="messages") from None
        prompt_ids = sup.tokenizer.encode(prompt_text, add_special_tokens=False)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = budget(len(prompt_ids), requested)
        params = sampling_params(lambda: req.to_sampling_params(max_tokens, {}))
        params.output_kind = RequestOutputKind.DELTA
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        model = sup.served_model_name
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        log.info("request", request_id=request_id, prompt_tokens=len(prompt_ids), max_tokens=max_tokens, stream=bool(req.stream))
        first, outputs = await first_then_rest(stream_outputs(prompt_ids, params, request_id))

        if req.stream:
            async def events() -> AsyncIterator[str]:
                n = 0
                role = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
                yield _sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[role]))
                try:
                    async for text, ids, finish in outputs:
                        n += len(ids)
                        choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=text), finish_reason=finish)
                        yield _sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))
                    if include_usage:
                        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n)
                        yield _sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
                except (EngineUnavailable, RequestFailed) as exc:
                    yield f"data: {json.dumps(_stream_error(exc))}\n\n"
                yield "data: [DONE]\n\n"
                log.info("request done", request_id=request_id, completion_tokens=n)

            return StreamingResponse(events(), media_type="text/event-stream")

        text, n, finish = "", 0, None
        async for t, i, f in outputs:
            text, finish = text + t, f or finish
            n += len(i)
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=n, total_tokens=len(prompt_ids) + n)
        choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=text), finish_reason=finish)
        log.info("request done", request_id=request_id, completion_tokens=n)
        return JSONResponse(ChatCompletionResponse(id=request_id, created=created, model=model, choices=[choice], usage=usage).model_dump(exclude_none=True))

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_request: Request, exc: EngineUnavailable) -> JSONResponse:
        return error_response(503, str(exc), "service_unavailable", headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(RequestFailed)
    async def _failed(_request: Request, exc: RequestFailed) -> JSONResponse:
        return error_response(503, str(exc), "engine_failure", headers={"Retry-After": "5"})

    # --- health ---------------------------------------------------------------------

    @app.get("/livez")
    async def livez() -> JSONResponse:
        return JSONResponse({"status": "alive", "state": sup.state.value})

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        """200 only when READY and the last probe passed; else 503 with the reason."""
        body = sup.status()
        if "verbose" not in request.query_params:
            body = {k: body[k] for k in ("state", "generation", "reason", "in_flight", "recoveries")}
        return JSONResponse(body, status_code=200 if sup.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """The supervisor's series (promtool-clean)."""
        return Response(generate_latest(sup.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/vllm")
    async def vllm_metrics() -> Response:
        """vLLM's own ``vllm:*`` series, as ``vllm serve`` exports them."""
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app


def _plain_message(message: Any) -> dict[str, Any]:
    """A chat message with its content flattened to text (the template sees plain strings)."""
    msg = dict(message)
    content = msg.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            part = dict(part)
            if part.get("type") != "text":
                raise ApiError(400, f"content part of type {part.get('type')!r} is not supported", param="messages")
            parts.append(part.get("text", ""))
        msg["content"] = "".join(parts)
    elif content is None:
        msg["content"] = ""
    return {"role": msg.get("role"), "content": msg["content"]}


def _stream_error(exc: Exception) -> dict[str, Any]:
    """A stream that already sent 200 ends with an error event (the client should retry)."""
    kind = "engine_failure" if isinstance(exc, RequestFailed) else "service_unavailable"
    return ErrorResponse(error=ErrorInfo(message=str(exc), type=kind, code=503)).model_dump()
