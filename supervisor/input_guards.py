"""Inputs that make the installed vLLM's front fail with a 500, answered with a 400 that says
what is wrong before vLLM sees them.

Found by fuzzing the daemon's OpenAPI schema (``fuzz/test_schemathesis.py``); ``vllm
serve`` 0.32.0 answers these with the same 500, the same code being vLLM's. Each guard is as
narrow as the crash: a request it lets through is answered by vLLM as before.
"""

from __future__ import annotations

import json
from typing import Any, Callable


def _responses_assistant_message(data: dict[str, Any]) -> str | None:
    """``/v1/responses``: an assistant ``message`` item in ``input`` whose content is empty or
    starts with a refusal. vLLM reads ``content[0].text`` (``responses/utils.py``):
    IndexError or AttributeError, a 500."""
    items = data.get("input")
    if not isinstance(items, list):
        return None
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and item.get("type") == "message" and item.get("role") == "assistant"):
            continue
        content = item.get("content")
        if isinstance(content, list) and (not content or (isinstance(content[0], dict) and content[0].get("type") == "refusal")):
            return f"input[{i}]: an assistant message must start its content with an output_text part"
    return None


GUARDS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    "/v1/responses": _responses_assistant_message,
}


def check(method: str, path: str, body: bytes) -> str | None:
    """The 400 message for a request vLLM would fail on, else None."""
    guard = GUARDS.get(path)
    if guard is None or method != "POST" or not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # vLLM answers malformed JSON with its own 400
    return guard(data) if isinstance(data, dict) else None


def error_body(message: str, param: str = "input") -> bytes:
    """vLLM's error shape."""
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}).encode()
