"""``Carryover``'s ``pristine`` copy of a request's sampling parameters is what a later engine
starts from: the first engine is given the client's own object, and vLLM's input processor
validates it in place (``SamplingParams.verify``), then clones it (shallowly for the OpenAI
front's parameters, ``skip_clone``) and adds the model's end-of-sequence ids to the clone. The
copy is shallow (under a microsecond instead of a deep copy's 18 µs per request), which holds
only while those steps rebind attributes and change nothing inside them beyond what the copy
copies: the installed vLLM's steps are run here, with the demo model's config and tokenizer, on
every kind of request the front builds, and the copy must still equal a deep copy taken before."""

from __future__ import annotations

import copy

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from supervisor.carryover import pristine
from supervisor.demo_model import build_demo_model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["city"]}

KINDS = {
    "greedy": dict(temperature=0),
    "seeded sampling": dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=7),
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    "logit bias": dict(logit_bias={5: 2.0, 9: -100.0}),
    "allowed token ids": dict(allowed_token_ids=[5, 6, 7, 8]),
    "stop strings and ids": dict(stop=["\n\n", "END"], stop_token_ids=[3], include_stop_str_in_output=True),
    "min tokens": dict(min_tokens=4),
    "logprobs": dict(logprobs=3, prompt_logprobs=2),
    "extra args": dict(extra_args={"note": {"nested": [1, 2]}}),
    "json schema": dict(structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    "json schema as text": dict(structured_outputs=StructuredOutputsParams(json='{"type": "object"}')),
    "json object": dict(structured_outputs=StructuredOutputsParams(json_object=True)),
    "regex": dict(structured_outputs=StructuredOutputsParams(regex="[a-c]{1,4}")),
    "choice": dict(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    "grammar": dict(structured_outputs=StructuredOutputsParams(grammar='root ::= "a" | "b" root')),
    "bad words": dict(bad_words=["hello", "the end"]),
}


@pytest.fixture(scope="module")
def validation(tmp_path_factory):
    """What vLLM's input processor validates with: the model config, the structured-output
    config (the server's default backend, ``auto``) and the tokenizer."""
    from vllm.config import StructuredOutputsConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers import get_tokenizer

    path = str(build_demo_model(tmp_path_factory.mktemp("data")))
    return EngineArgs(model=path).create_model_config(), None, StructuredOutputsConfig(), get_tokenizer(path)


def params(**kind) -> SamplingParams:
    """A fresh request of ``kind`` as the OpenAI front builds it (``skip_clone``; validation
    rewrites the kind's own structured outputs, so each gets a copy)."""
    return SamplingParams(max_tokens=16, output_kind=RequestOutputKind.DELTA, skip_clone=True, **copy.deepcopy(kind))


def engine_steps(given: SamplingParams, validation) -> None:
    """What the first engine's input processor does with the object it is given
    (``InputProcessor._validate_params`` and ``process_inputs``)."""
    model_config, _, _, tokenizer = validation
    given.verify(*validation)
    local = given.clone()
    local.update_from_generation_config(model_config.try_get_generation_config(), tokenizer.eos_token_id)
    local.update_from_tokenizer(tokenizer)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_engines_steps_leave_the_pristine_copy_as_it_was(validation, kind):
    given = params(**KINDS[kind])
    before = copy.deepcopy(given)
    copied = pristine(given)
    engine_steps(given, validation)
    assert copied == before
    assert copied.structured_outputs == before.structured_outputs
    assert copied._all_stop_token_ids == before._all_stop_token_ids


def test_the_copies_inside_are_needed(validation):
    """The check above can fail: validation rewrites a choice as a grammar and records its
    backend on the structured-output parameters, and the clone adds the end-of-sequence id to
    the stop ids' set, both of which a copy of the request alone shares."""
    given = params(**KINDS["choice"])
    before = copy.deepcopy(given)
    shallow = copy.copy(given)
    engine_steps(given, validation)
    assert shallow.structured_outputs != before.structured_outputs
    assert shallow._all_stop_token_ids != before._all_stop_token_ids
