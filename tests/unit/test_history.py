"""A continued request's past in the worker (``executor.history``), on vLLM's own sampler steps
and request state: the continued engine penalises, forbids and draws as the failed one would have."""

import pytest
import torch
from vllm import SamplingParams

from executor import history
from executor.resume import RESUME_IDS_KEY

history.install()

from vllm.v1.sample import sampler  # noqa: E402  (after install: the patched module attributes)
from vllm.v1.worker.gpu_input_batch import CachedRequestState  # noqa: E402

VOCAB = 32
PROMPT = [1, 2, 3, 4]
DELIVERED = [5, 6, 5, 7]
LATER = [8, 5]


def state(params: SamplingParams, prompt: list[int]) -> CachedRequestState:
    """The request state vLLM's model runner creates for a new request (``_update_states``)."""
    gen = None
    if params.seed is not None:
        gen = torch.Generator()
        gen.manual_seed(params.seed)
    return CachedRequestState(req_id="r", prompt_token_ids=list(prompt), mm_features=[], sampling_params=params,
                              generator=gen, block_ids=([],), num_computed_tokens=0, output_token_ids=[])


def continued(**kwargs) -> CachedRequestState:
    params = SamplingParams(max_tokens=20, extra_args={RESUME_IDS_KEY: DELIVERED}, **kwargs)
    s = state(params, PROMPT + DELIVERED)
    s.output_token_ids.extend(LATER)  # as the model runner appends sampled tokens
    return s


class Metadata:
    """The fields of vLLM's ``SamplingMetadata`` its penalty step reads."""

    def __init__(self, prompt: list[int], presence: float, frequency: float, repetition: float):
        self.no_penalties = False
        self.prompt_token_ids = torch.tensor([prompt])
        self.presence_penalties = torch.tensor([presence])
        self.frequency_penalties = torch.tensor([frequency])
        self.repetition_penalties = torch.tensor([repetition])


@pytest.mark.parametrize("presence, frequency, repetition", [(0.5, 0, 1), (0, 0.7, 1), (0.4, 0.3, 1.3)])
def test_penalties_count_the_delivered_tokens_as_generated(presence, frequency, repetition):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    fault_free = sampler.Sampler.apply_penalties(
        logits.clone(), Metadata(PROMPT, presence, frequency, repetition), [DELIVERED + LATER])
    s = continued(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    assert list(s.output_token_ids) == LATER and s.num_tokens == len(PROMPT + DELIVERED + LATER)  # positions unchanged
    after_seam = sampler.Sampler.apply_penalties(
        logits.clone(), Metadata(PROMPT + DELIVERED, presence, frequency, repetition), [s.output_token_ids])
    assert torch.equal(after_seam, fault_free)
    uncarried = sampler.Sampler.apply_penalties(
        logits.clone(), Metadata(PROMPT + DELIVERED, presence, frequency, repetition), [list(LATER)])
    assert not torch.equal(uncarried, fault_free)  # what the new engine did before this module


def test_a_bad_word_straddling_the_seam_is_still_forbidden():
    s = continued(bad_words=[])
    bad = {0: [[7, 8, 5, 9]]}  # 7 was delivered, 8 and 5 came after the seam: 9 is forbidden next
    logits = torch.zeros(1, VOCAB)
    sampler.apply_bad_words(logits, bad, [s.output_token_ids])
    assert logits[0, 9] == float("-inf")
    plain = torch.zeros(1, VOCAB)
    sampler.apply_bad_words(plain, bad, [list(LATER)])
    assert plain[0, 9] == 0


def test_a_seeded_stream_resumes_after_the_delivered_draws():
    fault_free = torch.Generator().manual_seed(11)
    draws = [torch.randint(0, 2**31, (1,), generator=fault_free, dtype=torch.long).item()
             for _ in range(len(DELIVERED) + 3)]  # what forward_cpu draws, one per step
    s = continued(temperature=0.8, seed=11)
    resumed = [torch.randint(0, 2**31, (1,), generator=s.generator, dtype=torch.long).item() for _ in range(3)]
    assert resumed == draws[len(DELIVERED):]


def test_a_replaced_output_list_keeps_its_history():
    """Async scheduling gives a request resumed from preemption a fresh output list."""
    s = continued(presence_penalty=0.5)
    s.output_token_ids = [8, 5, 9]
    assert type(s.output_token_ids) is history.Delivered and s.output_token_ids.delivered == DELIVERED
    assert history.with_history([s.output_token_ids]) == [DELIVERED + [8, 5, 9]]


def test_other_requests_are_untouched():
    s = state(SamplingParams(max_tokens=5, presence_penalty=0.5, temperature=0.5, seed=3), PROMPT)
    assert type(s) is CachedRequestState and type(s.output_token_ids) is list
    rows = [[1, 2], [3]]
    assert history.with_history(rows) is rows
    assert torch.randint(0, 2**31, (1,), generator=s.generator).item() == \
        torch.randint(0, 2**31, (1,), generator=torch.Generator().manual_seed(3)).item()


def test_the_cpu_engines_carry_a_requests_past():
    """The demo model's real engine config (CPU, Ray executor, V1 model runner): nothing refused."""
    from tests.unit.test_http_front_fake_engine import demo_front

    config = demo_front()[1]
    assert config.use_v2_model_runner is False
    assert history.history_refusal(config) is None and history.replay_refusal(config) is None


@pytest.mark.parametrize("config, fragment", [
    ({"parallel_config": {"distributed_executor_backend": "mp"}}, "mp executor"),
    ({"speculative_config": object()}, "speculative decoding"),
    ({"use_v2_model_runner": True}, "V2 model runner"),
])
def test_engines_that_do_not_carry_a_requests_past_are_named(config, fragment):
    from types import SimpleNamespace

    ns = SimpleNamespace(**{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in config.items()})
    assert fragment in history.history_refusal(ns)
