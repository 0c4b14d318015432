"""One request's state across engine seams: what reached the client, and what the next engine
needs to continue it exactly (``supervisor.continuation`` holds the pure steps).

``Streams._choice`` drives it, one per choice of an ``n > 1`` request: ``next_request`` gives
the engine request of each attempt (the request as sent, or its continuation after a seam),
``take`` turns an engine output into what the client reads and records it, ``final`` makes the
one answer of a non-streamed request. A new
kind of request that needs state across a seam adds a field here and a step in
``continuation``, not another branch in the stream loop.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from vllm.sampling_params import RequestOutputKind

from executor.engine import logprob_token_strings
from executor.resume import RESUME_IDS_KEY
from supervisor.continuation import (
    Engines, NotContinuable, SeamLogprobs, SeamText, continuation_input, continuation_params, why_not_continuable,
)
from supervisor.suspects import Record


class Carryover:
    def __init__(self, prompt: Any, params: Any, kwargs: dict[str, Any], request_id: str,
                 detokenizer: Callable[[list[int], Any, str], Any], tokenizer: Callable[[], Any],
                 engines: Engines = Engines()):
        if RESUME_IDS_KEY in (params.extra_args or {}):  # only a continuation may set it (executor.resume)
            params = copy.copy(params)
            params.extra_args = {k: v for k, v in params.extra_args.items() if k != RESUME_IDS_KEY}
        # The front's non-streaming mode (FINAL_ONLY) runs as a stream and is answered with one
        # output at the end, so it continues mid-way too; one that cannot be continued runs as
        # asked and, interrupted, simply runs again (nothing was sent).
        self.engines = engines  # what the serving engines carry across a seam
        self.final_only = params.output_kind == RequestOutputKind.FINAL_ONLY and self._why_not(params) is None
        if self.final_only:
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.DELTA
        self.params = params  # what the stream runs with (DELTA for a FINAL_ONLY request)
        # The first engine is given ``params`` itself, as `vllm serve` gives it: vLLM's input
        # processor writes to it before its own copy, so a later attempt starts from this one,
        # taken before any engine saw it (``pristine``).
        self.pristine = pristine(params)
        self._given = False  # the first engine got ``params``
        self.delta = params.output_kind == RequestOutputKind.DELTA
        self.prompt, self.kwargs, self.request_id = prompt, kwargs, request_id
        self._detokenizer, self._tokenizer = detokenizer, tokenizer
        # what the client has read
        self.prompt_ids: list[int] | None = None
        self.prompt_text: str | None = None
        self.prompt_logprobs: Any = None
        # the client's prompt's prefix-cache hits and writes, as its first engine counted them
        self.cache_counts: tuple[int | None, int | None] = (None, None)
        self.ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[dict[int, Any]] = []
        self.cumulative_logprob: float | None = None
        self.yielded = False
        # after a seam: the text and the logprobs' token strings as the first engine would make them
        self._text_seam: SeamText | None = None
        self._logprobs_seam: SeamLogprobs | None = None
        self.suspect = Record()  # its part in engine failures (supervisor.suspects)

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt's token ids: as the first engine read them, else as the front sent them."""
        if self.prompt_ids:
            return self.prompt_ids
        return self.prompt.get("prompt_token_ids") if isinstance(self.prompt, dict) else None

    def _why_not(self, params: Any) -> str | None:
        return why_not_continuable(params, self.engines)

    def next_request(self) -> tuple[Any, Any, dict[str, Any]]:
        """(params, prompt, kwargs) for the next engine: the request as sent while nothing
        reached the client, else its continuation. Raises ``NotContinuable``."""
        if not self.yielded and not self.ids:
            first, self._given = not self._given, True
            return (self.params if first else copy.deepcopy(self.pristine)), self.prompt, self.kwargs
        if not self.delta:  # a FINAL_ONLY output is only yielded at the end
            raise NotContinuable(f"output kind {self.params.output_kind.name}")
        if (reason := self._why_not(self.pristine)) is not None:
            raise NotContinuable(reason)
        sub = continuation_params(self.pristine, self.ids, self.engines)
        engine_prompt = continuation_input(self.prompt, self.prompt_ids or [], self.ids)
        kw = {k: v for k, v in self.kwargs.items() if k not in ("prompt_text", "tokenization_kwargs")}
        if self._text_seam is None:
            self._text_seam = SeamText(self._detokenizer(self.prompt_ids or [], self.pristine, self.request_id),
                                       self.ids, "".join(self.text))
        if self.pristine.logprobs is not None:  # per engine: its cumulative logprob starts at 0
            self._logprobs_seam = SeamLogprobs(logprob_token_strings, self._tokenizer(), self.ids, self.cumulative_logprob)
        return sub, engine_prompt, kw

    def take(self, out: Any) -> Any:
        """An engine output -> what the client reads (the same object, rewritten after a seam);
        records it. A stop string found across the seam finishes it."""
        c = out.outputs[0]
        self.suspect.outputs_here += 1
        if self.prompt_ids is None:
            self.prompt_ids, self.prompt_text = list(out.prompt_token_ids or []), getattr(out, "prompt", None)
            self.prompt_logprobs = getattr(out, "prompt_logprobs", None)
            self.cache_counts = (getattr(out, "num_cached_tokens", None), getattr(out, "num_cache_creation_tokens", None))
        if self._text_seam is not None:
            new = len(c.token_ids)
            c.text, c.token_ids, c.finish_reason, c.stop_reason = self._text_seam.step(
                c.token_ids, c.finish_reason, c.stop_reason)
            if self._logprobs_seam is not None:
                lps = c.logprobs[:new] if c.logprobs is not None else None
                c.logprobs, c.cumulative_logprob = self._logprobs_seam.step(lps, c.token_ids, c.cumulative_logprob)
            out.prompt_token_ids, out.prompt, out.prompt_logprobs = self.prompt_ids, self.prompt_text, None
            # the usage's cache counts (``prompt_tokens_details``, the Responses API's
            # ``input_tokens_details``) are the client's prompt's, as its first engine counted
            # them (vLLM's are per request): the continuation's own prompt (that prompt and the
            # tokens read so far) may hit a cache the first engine's did not (another replica
            # that ran the same text), or write more
            out.num_cached_tokens, out.num_cache_creation_tokens = self.cache_counts
            out.finished = c.finish_reason is not None
        if self.delta:
            self.ids += c.token_ids
            self.text.append(c.text)
            if getattr(c, "logprobs", None):
                self.logprobs += c.logprobs
            if getattr(c, "cumulative_logprob", None) is not None:
                self.cumulative_logprob = c.cumulative_logprob
        return out

    def final(self, out: Any) -> Any:
        """The one output of a FINAL_ONLY request, from the last engine output."""
        c = out.outputs[0]
        c.text, c.token_ids = "".join(self.text), list(self.ids)
        if self.pristine.logprobs is not None:
            c.logprobs, c.cumulative_logprob = list(self.logprobs), self.cumulative_logprob
        out.prompt_logprobs = self.prompt_logprobs
        return out


def pristine(params: Any) -> Any:
    """A copy of ``params`` that what the engine does to ``params`` leaves as it is.

    vLLM's input processor validates the caller's object (``SamplingParams.verify``), which
    rebinds attributes of ``params`` (the prompt logprobs' token ids as an array) and of its
    ``structured_outputs`` (the backend it chose, a choice rewritten as a grammar). Then it
    clones it, shallowly for the OpenAI front's parameters (``skip_clone``), and adds the
    model's end-of-sequence ids to the clone's ``_all_stop_token_ids``: the caller's set, in
    place. Nothing else inside is changed. So shallow copies of the three are enough: under a
    microsecond, where a deep copy took 18 µs of every request on the front's loop.
    ``tests/unit/test_pristine.py`` runs the installed vLLM's steps on every kind of request
    to hold it to that."""
    copied = copy.copy(params)
    if params.structured_outputs is not None:
        copied.structured_outputs = copy.copy(params.structured_outputs)
    copied._all_stop_token_ids = set(params._all_stop_token_ids)
    return copied
