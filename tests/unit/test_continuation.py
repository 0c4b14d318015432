"""Which requests can be continued exactly, and with which parameters."""

import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from executor.resume import RESUME_IDS_KEY
from supervisor.continuation import Engines, NotContinuable, continuation_params, why_not_continuable

IDS = list(range(100, 140))


def test_greedy_continuation_keeps_everything_but_the_budget():
    p = SamplingParams(temperature=0, max_tokens=100, min_tokens=30, ignore_eos=True, stop_token_ids=[7])
    sub = continuation_params(p, IDS[:40])
    assert sub.max_tokens == 60 and sub.min_tokens == 0
    assert sub.ignore_eos and sub.stop_token_ids == [7] and sub.temperature == 0
    assert p.max_tokens == 100 and p.min_tokens == 30  # the original is untouched


def test_min_tokens_shrinks_by_what_was_delivered():
    p = SamplingParams(temperature=0, max_tokens=100, min_tokens=30)
    assert continuation_params(p, IDS[:10]).min_tokens == 20


def test_nothing_delivered_resubmits_a_fresh_copy():
    p = SamplingParams(temperature=0.8, seed=3, max_tokens=5)
    sub = continuation_params(p, [])
    assert sub is not p and (sub.temperature, sub.seed, sub.max_tokens) == (0.8, 3, 5)


CARRIED = [  # kinds whose past on the failed engine its workers carry (executor.history)
    {"presence_penalty": 0.5},
    {"frequency_penalty": 0.5},
    {"temperature": 0.7, "seed": 1},
    {"bad_words": ["fox jumps"]},
]


@pytest.mark.parametrize("kwargs", CARRIED)
def test_penalties_bad_words_and_seeds_travel_with_the_delivered_tokens(kwargs):
    p = SamplingParams(max_tokens=50, **kwargs)
    assert why_not_continuable(p) is None
    sub = continuation_params(p, [5, 6, 7])
    assert sub.extra_args == {RESUME_IDS_KEY: [5, 6, 7]}
    for key, value in kwargs.items():
        assert getattr(sub, key) == value  # the workers apply them as the first engine did


@pytest.mark.parametrize(
    "kwargs, engines, fragment",
    [
        ({"n": 2}, Engines(), "n > 1"),
        ({"presence_penalty": 0.5}, Engines(history="mp executor"), "penalties: mp executor"),
        ({"frequency_penalty": 0.5}, Engines(history="mp executor"), "penalties: mp executor"),
        ({"bad_words": ["fox jumps"]}, Engines(history="mp executor"), "bad_words: mp executor"),
        ({"temperature": 0.7, "seed": 1}, Engines(replay="GPU sampler"), "seeded sampling: GPU sampler"),
        ({"temperature": 0.7, "seed": 1}, Engines(history="mp executor"), "seeded sampling: mp executor"),
    ],
)
def test_not_exactly_continuable(kwargs, engines, fragment):
    p = SamplingParams(max_tokens=50, **kwargs)
    assert fragment in why_not_continuable(p, engines)
    with pytest.raises(NotContinuable, match=fragment):
        continuation_params(p, [1, 2, 3], engines)


def test_what_engines_cannot_carry_matters_only_to_requests_that_need_it():
    engines = Engines(history="mp executor", replay="GPU sampler")
    for p in (SamplingParams(temperature=0, max_tokens=8, seed=4),  # greedy: no random stream
              SamplingParams(temperature=0.9, max_tokens=8),
              SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=8)):
        assert why_not_continuable(p, engines) is None


def test_a_structured_request_carries_its_delivered_tokens_to_the_next_grammar():
    p = SamplingParams(temperature=0, max_tokens=50, structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
                       extra_args={"kv_transfer_params": {"x": 1}})
    assert why_not_continuable(p) is None
    sub = continuation_params(p, [7, 8, 9])
    assert sub.extra_args == {"kv_transfer_params": {"x": 1}, RESUME_IDS_KEY: [7, 8, 9]}
    assert p.extra_args == {"kv_transfer_params": {"x": 1}}  # the client's own params untouched
    with pytest.raises(NotContinuable, match="reasoning parser"):
        continuation_params(p, [7, 8, 9], Engines(reasoning=True))


def test_unseeded_sampling_and_repetition_penalty_are_continuable():
    assert why_not_continuable(SamplingParams(temperature=0.9, max_tokens=8)) is None
    assert why_not_continuable(SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=8)) is None


def test_no_budget_left():
    with pytest.raises(NotContinuable, match="budget"):
        continuation_params(SamplingParams(temperature=0, max_tokens=5), IDS[:5])


def test_stop_strings_are_continued_by_the_supervisor_not_the_engine():
    p = SamplingParams(temperature=0, max_tokens=50, stop=["\n", "END"], include_stop_str_in_output=False)
    assert why_not_continuable(p) is None
    sub = continuation_params(p, IDS[:3])
    assert sub.stop == [] and sub.output_text_buffer_length == 0 and sub.detokenize is False
    assert p.stop == ["\n", "END"] and p.detokenize  # the original (used by SeamText) keeps them
