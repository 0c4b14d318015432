"""A load client that records every request: concurrent streams through the ``openai`` SDK.

Each request is a greedy streamed completion with ``return_token_ids`` so its output can be
compared token for token with a fault-free reference run of the same prompts.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import openai

PROMPTS = [
    "The quick brown fox", "Once upon a time", "def main(): return", "In the beginning",
    "Numbers like 100, 2024", "Hello there, friend", "A small model", "The supervisor keeps",
    "Ray actors run", "Shared memory rings", "Greedy decoding is", "Streams continue on",
]


@dataclass
class RequestRecord:
    index: int
    prompt: str
    max_tokens: int
    outcome: str = "pending"  # ok | error
    error: str = ""
    status: int | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    usage_completion_tokens: int | None = None
    started: float = 0.0  # time.monotonic()
    chunk_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("chunk_times")
        d["first_chunk_after"] = self.chunk_times[0] - self.started if self.chunk_times else None
        return d


def client(base_url: str, api_key: str = "unused", timeout_s: float = 600) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s)


async def stream_one(api: openai.AsyncOpenAI, model: str, record: RequestRecord) -> RequestRecord:
    record.started = time.monotonic()
    try:
        stream = await api.completions.create(
            model=model, prompt=record.prompt, max_tokens=record.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in stream:
            now = time.monotonic()
            if chunk.usage is not None:
                record.usage_completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices or []:
                record.chunk_times.append(now)
                record.text += choice.text
                record.token_ids += list(getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids") or [])
                record.finish_reason = choice.finish_reason or record.finish_reason
            error = (chunk.model_extra or {}).get("error")
            if error:
                raise RuntimeError(f"stream error: {error}")
        record.outcome = "ok"
    except openai.APIStatusError as exc:
        record.outcome, record.status, record.error = "error", exc.status_code, str(exc)[:500]
    except Exception as exc:
        record.outcome, record.error = "error", f"{type(exc).__name__}: {exc}"[:500]
    return record


def compare(records: list[RequestRecord], reference: dict[str, list[int]]) -> dict[str, int]:
    """Counts of ok / failed requests and of duplicated / missing / mismatched tokens."""
    out = {"ok": 0, "failed": 0, "mismatched": 0, "tokens_duplicated": 0, "tokens_missing": 0}
    for r in records:
        if r.outcome != "ok":
            out["failed"] += 1
            continue
        out["ok"] += 1
        want = reference[r.prompt][: r.max_tokens]
        got = r.token_ids
        if got != want:
            out["mismatched"] += 1
            out["tokens_duplicated"] += max(0, len(got) - len(want))
            out["tokens_missing"] += max(0, len(want) - len(got))
    return out


async def run_with_fault(
    base_url: str, n: int, max_tokens: int, fault=None, min_tokens_before_fault: int = 8, offset: int = 0,
    model: str = "demo-tiny-llama", api_key: str = "unused",
) -> tuple[list[RequestRecord], Any]:
    """Run ``n`` streams; once every one has ``min_tokens_before_fault`` tokens, call
    ``fault()`` in a thread (so it may block on Ray). Returns the records and what
    ``fault()`` returned."""
    api = client(base_url, api_key)
    records = [RequestRecord(i, PROMPTS[(i + offset) % len(PROMPTS)], max_tokens) for i in range(n)]
    tasks = [asyncio.create_task(stream_one(api, model, r)) for r in records]
    fault_info = None
    try:
        if fault is not None:
            deadline = time.monotonic() + 120
            while any(len(r.token_ids) < min_tokens_before_fault for r in records):
                if time.monotonic() > deadline or all(t.done() for t in tasks):
                    raise RuntimeError(f"streams did not start: {[r.error for r in records if r.error]}")
                await asyncio.sleep(0.01)
            if any(r.finish_reason for r in records):
                raise RuntimeError("a stream finished before the fault; use more max_tokens")
            fault_info = await asyncio.to_thread(fault)
            if all(t.done() and r.outcome == "ok" for t, r in zip(tasks, records)):
                # e.g. a first Ray connection inside fault() that took longer than the streams
                raise RuntimeError("every stream finished before fault() returned: the fault did not land mid-stream")
        await asyncio.gather(*tasks)
    finally:
        await api.close()
    return records, fault_info


def first_token_after(records: list[RequestRecord], t: float) -> float | None:
    """The earliest chunk any stream received after monotonic time ``t``."""
    later = [c for r in records for c in r.chunk_times if c > t]
    return min(later) if later else None
