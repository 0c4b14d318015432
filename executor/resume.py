"""Inside the engine core: a continued request's structured-output grammar starts where the
failed engine's stopped.

A request continued after a seam is sent as prompt + delivered tokens, so the new engine's
grammar (xgrammar, guidance, outlines, lm-format-enforcer) would start at its beginning and
constrain the continuation as if nothing had been generated: a JSON object begun before the
fault would be begun again. The supervisor passes the delivered tokens in
``SamplingParams.extra_args[RESUME_IDS_KEY]``; when vLLM's structured-output manager creates the
request's grammar (``StructuredOutputManager._create_grammar``, on the scheduler's side, in
a compile thread), the grammar accepts them before the request's first step, exactly as the
failed engine's grammar accepted them one step at a time.

Installed by every supervised executor in the engine core (``install``); a no-op for requests
without the key.
"""

from __future__ import annotations

from typing import Any

RESUME_IDS_KEY = "vllm_supervisor_resume_ids"

_installed = False


class ResumeRefused(ValueError):
    """The delivered tokens cannot be replayed into the request's grammar."""


def resumed(grammar: Any, request: Any, manager: Any) -> Any:
    """``grammar`` advanced over the delivered tokens of ``request`` (none: unchanged)."""
    args = getattr(request.sampling_params, "extra_args", None) or {}
    delivered = args.get(RESUME_IDS_KEY)
    if not delivered:
        return grammar
    if getattr(manager, "reasoner_cls", None) is not None:
        # where the reasoning ended among the delivered tokens is the reasoning parser's state
        raise ResumeRefused("a structured-output request is not continued with a reasoning parser")
    if not grammar.accept_tokens(request.request_id, list(delivered)):
        raise ResumeRefused(f"the grammar rejected the {len(delivered)} delivered tokens")
    return grammar


def install() -> None:
    """Wrap vLLM's grammar creation in this process (once)."""
    global _installed
    if _installed:
        return
    from vllm.v1.structured_output import StructuredOutputManager

    create = StructuredOutputManager._create_grammar

    def _create_grammar(self: Any, request: Any) -> Any:
        return resumed(create(self, request), request, self)

    StructuredOutputManager._create_grammar = _create_grammar
    _installed = True
