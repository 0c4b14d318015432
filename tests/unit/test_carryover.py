"""``Carryover``, one request's state across seams, over vLLM's own detokenizer, logprobs
processor and demo tokenizer (no engine): a request with logprobs, streamed or not, cut at
every token, reads what a fault-free run reads."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from executor.engine import new_detokenizer
from supervisor.carryover import Carryover
from supervisor.continuation import Engines, NotContinuable
from supervisor.demo_model import build_demo_model
from tests.unit.test_seam_text import reference_logprobs

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(build_demo_model(tmp_path_factory.mktemp("data"))))


def engine_outputs(tok, ids, params, positions, detokenize=True):
    """One engine's DELTA outputs for ``ids``: text from vLLM's detokenizer (or none), the
    logprobs of each token from vLLM's logprobs processor, the running cumulative logprob."""
    d = new_detokenizer(tok, PROMPT, params, "r")
    out = []
    for i, t in enumerate(ids):
        d.update([t], False)
        done = "length" if i == len(ids) - 1 else None
        text = d.get_next_output_text(done is not None, True) if detokenize else ""
        lps, cumulative = reference_logprobs(tok, positions[: i + 1], detokenize)
        c = SimpleNamespace(token_ids=[t], text=text, finish_reason=done, stop_reason=None,
                            logprobs=lps[-1:], cumulative_logprob=cumulative)
        out.append(SimpleNamespace(outputs=[c], finished=done is not None, prompt_token_ids=PROMPT, prompt=None,
                                   prompt_logprobs=None))
    return out


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_logprobs_are_carried_across_every_seam(tokenizer, kind):
    ids = tokenizer.encode("naïve café 日本語 🙂 done", add_special_tokens=False)
    positions = [([t, 40, 41], [-0.5, -1.5, -2.5], 1) for t in ids]
    params = SamplingParams(temperature=0, max_tokens=len(ids), logprobs=2, ignore_eos=True, output_kind=kind)
    whole, whole_cumulative = reference_logprobs(tokenizer, positions)
    for k in range(1, len(ids)):
        req = Carryover({"prompt_token_ids": PROMPT}, copy.deepcopy(params), {}, "r",
                        lambda p, sp, rid: new_detokenizer(tokenizer, p, sp, rid), lambda: tokenizer)
        assert req.next_request()[0].logprobs == 2
        read = [req.take(o) for o in engine_outputs(tokenizer, ids, params, positions)[:k]]
        sub, prompt, _ = req.next_request()  # the seam
        assert sub.logprobs == 2 and not sub.detokenize and prompt["prompt_token_ids"] == PROMPT + ids[:k]
        new = engine_outputs(tokenizer, ids[k:], sub, positions[k:], detokenize=False)
        read += [req.take(o) for o in new]
        if kind is RequestOutputKind.FINAL_ONLY:
            final = req.final(read[-1]).outputs[0]
            assert final.logprobs == whole and final.token_ids == ids and final.text == tokenizer.decode(ids), k
            assert abs(final.cumulative_logprob - whole_cumulative) < 1e-9
        else:
            assert [p for o in read for p in o.outputs[0].logprobs] == whole, k
            assert abs(read[-1].outputs[0].cumulative_logprob - whole_cumulative) < 1e-9


def test_flat_logprobs_are_refused_with_their_reason(tokenizer):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, flat_logprobs=True, output_kind=RequestOutputKind.DELTA)
    req = Carryover({"prompt_token_ids": PROMPT}, params, {}, "r", None, lambda: tokenizer)
    req.ids, req.yielded = [9], True
    with pytest.raises(NotContinuable, match="flat logprobs"):
        req.next_request()


def test_structured_outputs_with_a_reasoning_parser_are_refused_and_run_again(tokenizer):
    from vllm.sampling_params import StructuredOutputsParams

    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        params = SamplingParams(temperature=0, max_tokens=8, output_kind=kind,
                                structured_outputs=StructuredOutputsParams(json_object=True))
        req = Carryover({"prompt_token_ids": PROMPT}, params, {}, "r", None, lambda: tokenizer,
                        Engines(reasoning=True))
        assert not req.final_only  # not streamed: interrupted, it runs again from the start
        if kind is RequestOutputKind.FINAL_ONLY:
            assert req.next_request()[1] == {"prompt_token_ids": PROMPT}
        else:
            req.ids, req.yielded = [9], True
            with pytest.raises(NotContinuable, match="reasoning parser"):
                req.next_request()
        plain = Carryover({"prompt_token_ids": PROMPT}, params, {}, "r", None, lambda: tokenizer)
        assert plain.final_only == (kind is RequestOutputKind.FINAL_ONLY)


def test_a_client_cannot_send_resume_ids_of_its_own(tokenizer):
    """Only a continuation tells the new engine's grammar which tokens were delivered: the key
    is taken out of what a client sends (``vllm_xargs``)."""
    from vllm.sampling_params import StructuredOutputsParams

    from executor.resume import RESUME_IDS_KEY

    params = SamplingParams(temperature=0, max_tokens=8, output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(json_object=True),
                            extra_args={RESUME_IDS_KEY: [1, 2, 3], "other": 1})
    req = Carryover({"prompt_token_ids": PROMPT}, params, {}, "r", None, lambda: tokenizer)
    sub, _, _ = req.next_request()
    assert sub.extra_args == {"other": 1} and params.extra_args[RESUME_IDS_KEY] == [1, 2, 3]


def test_cached_tokens_after_a_seam_are_the_clients_prompts_on_its_first_engine(tokenizer):
    """The continuation's prompt (the client's and the tokens read so far) can hit a prefix
    cache the first engine's did not (another replica that ran the same text) and write more:
    the usage's cache counts stay what the first engine counted for the client's prompt."""
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    positions = [([t], [-0.5], 1) for t in ids]
    params = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    req = Carryover({"prompt_token_ids": PROMPT}, copy.deepcopy(params), {}, "r",
                    lambda p, sp, rid: new_detokenizer(tokenizer, p, sp, rid), lambda: tokenizer)
    first = engine_outputs(tokenizer, ids, params, positions)[:2]
    for o in first:
        o.num_cached_tokens, o.num_cache_creation_tokens = 0, 3
    read = [req.take(o) for o in first]
    sub, _, _ = req.next_request()  # the seam
    later = engine_outputs(tokenizer, ids[2:], sub, positions[2:], detokenize=False)
    for o in later:  # the other replica had the continuation's prefix cached, and wrote the rest
        o.num_cached_tokens, o.num_cache_creation_tokens = 16, 128
    read += [req.take(o) for o in later]
    assert [(o.num_cached_tokens, o.num_cache_creation_tokens) for o in read] == [(0, 3)] * len(ids)


def test_the_first_engine_gets_the_clients_params_and_a_later_attempt_a_copy_from_before_it():
    """vLLM's input processor writes to the parameters it is given before it copies them
    (``verify``: the structured-output backend it chose, a choice rewritten as a grammar; it
    rebinds attributes, ``test_pristine`` holds it to that). The first engine gets the client's
    object, as in `vllm serve`; a retry (nothing sent yet) and a continuation start from a copy
    taken before any engine saw it."""
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=4, stop=["x"], output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    req = Carryover({"prompt_token_ids": PROMPT}, params, {}, "r", None, None)
    first = req.next_request()[0]
    assert first is params
    first.structured_outputs.choice, first.structured_outputs.grammar = None, 'root ::= "a" | "b"'
    first.stop = ["x", "written by the first engine"]
    first.max_tokens = 1
    retry = req.next_request()[0]
    assert retry is not params and retry.stop == ["x"] and retry.max_tokens == 4
    assert retry.structured_outputs.choice == ["a", "b"] and retry.structured_outputs.grammar is None
    assert req.next_request()[0] is not retry  # each retry its own copy
