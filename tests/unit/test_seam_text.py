"""The text across a seam, with the real demo tokenizer and vLLM's own incremental
detokenizer (no engine): for every seam position, what the client reads from the first
engine plus what ``SeamText`` makes of the second engine's token ids equals the fault-free
text, token ids, finish and stop reason. The demo tokenizer is byte-level BPE, so many seams
fall inside a multi-byte UTF-8 character."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from executor.engine import new_detokenizer
from supervisor.continuation import SeamText, continuation_params
from supervisor.demo_model import build_demo_model
from supervisor.testhooks import ends_mid_character

EOS = 2  # the demo tokenizer's </s>


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(build_demo_model(tmp_path_factory.mktemp("data"))))


def engine_stream(tok, prompt, ids, params, upto=None):
    """What one engine's output processor sends in DELTA mode for ``ids`` (vLLM's own
    detokenizer, one token per step); stops after ``upto`` tokens as a fault would."""
    d = new_detokenizer(tok, prompt, params, "r")
    out = []
    for i, t in enumerate(ids[:upto]):
        finish = "stop" if t == EOS else "length" if i == len(ids) - 1 else None
        before = d.num_output_tokens()
        stop = d.update([t], finish == "stop")
        finish = "stop" if stop else finish
        out.append((d.get_next_output_text(finish is not None, True), list(d.output_token_ids[before:]),
                    finish, stop))
        if finish:
            break
    return out


def seamed_stream(tok, prompt, ids, params, seams):
    """The same request with faults after each token count in ``seams``: the first engine's
    deltas up to the first seam, then ``SeamText`` over the token ids of the next engines."""
    first = engine_stream(tok, prompt, ids, params, upto=seams[0])
    delivered = [t for _, tt, _, _ in first for t in tt]
    seam = None
    out = list(first)
    if first and first[-1][2]:
        return out
    for k, end in zip(seams, seams[1:] + [len(ids)]):
        sub = continuation_params(params, delivered)
        assert sub.stop == [] and not sub.detokenize  # the new engine makes ids only
        if seam is None:
            seam = SeamText(new_detokenizer(tok, prompt, params, "r-c"), delivered, "".join(x[0] for x in out))
        for i in range(k, end):
            finish = "stop" if ids[i] == EOS else "length" if i == len(ids) - 1 else None
            step = seam.step([ids[i]], finish)
            out.append(step)
            delivered += step[1]
            if step[2]:
                return out
    return out


def summary(stream):
    return ("".join(s[0] for s in stream), [t for s in stream for t in s[1]], stream[-1][2], stream[-1][3])


def random_ids(rng, tok, n):
    """Noise like the demo model's output, with real multi-byte characters mixed in."""
    ids = []
    while len(ids) < n:
        if rng.random() < 0.3:
            ids += tok.encode(rng.choice(["é", " 日本", "✓", " 😀", "ß", "Ω"]), add_special_tokens=False)
        else:
            ids.append(rng.randrange(3, 512))
    return ids[:n]


def test_every_seam_position_reads_like_a_fault_free_run(tokenizer):
    rng = random.Random(0)
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=48)
    mid_char = 0
    for _ in range(40):
        ids = random_ids(rng, tokenizer, 48)
        want = summary(engine_stream(tokenizer, prompt, ids, params))
        for k in range(1, len(ids)):
            mid_char += ends_mid_character(tokenizer, ids[:k])
            assert summary(seamed_stream(tokenizer, prompt, ids, params, [k])) == want, k
    assert mid_char > 100  # the case that matters is well covered


def test_several_seams_in_one_request(tokenizer):
    rng = random.Random(1)
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=64)
    for _ in range(60):
        ids = random_ids(rng, tokenizer, 64)
        seams = sorted(rng.sample(range(1, 64), 3))
        assert summary(seamed_stream(tokenizer, prompt, ids, params, seams)) == summary(
            engine_stream(tokenizer, prompt, ids, params))


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_are_found_on_the_joined_text(tokenizer, include):
    """Stop strings taken from the fault-free text, so they occur; every seam position,
    including those inside the stop string and inside the held-back text."""
    rng = random.Random(2)
    prompt = tokenizer.encode("A small model", add_special_tokens=False)
    hits = 0
    for _ in range(25):
        ids = [t for t in random_ids(rng, tokenizer, 40) if t != EOS]
        text = summary(engine_stream(tokenizer, prompt, ids, SamplingParams(temperature=0, max_tokens=40)))[0]
        if len(text) < 20:
            continue
        at = rng.randrange(5, len(text) - 6)
        stops = [text[at:at + rng.randrange(2, 6)], "never-in-noise"]
        params = SamplingParams(temperature=0, max_tokens=40, stop=stops, include_stop_str_in_output=include)
        want = summary(engine_stream(tokenizer, prompt, ids, params))
        hits += want[2] == "stop"
        for k in range(1, len(want[1])):
            assert summary(seamed_stream(tokenizer, prompt, ids, params, [k])) == want, (k, stops)
    assert hits >= 10


def test_min_tokens_and_eos(tokenizer):
    rng = random.Random(3)
    prompt = tokenizer.encode("Numbers like 100", add_special_tokens=False)
    for _ in range(20):
        ids = random_ids(rng, tokenizer, 30) + [EOS]
        text = summary(engine_stream(tokenizer, prompt, ids, SamplingParams(temperature=0, max_tokens=40)))[0]
        params = SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop=[text[8:10]])
        want = summary(engine_stream(tokenizer, prompt, ids, params))
        for k in range(1, len(want[1])):
            assert summary(seamed_stream(tokenizer, prompt, ids, params, [k])) == want, k


def test_chat_with_a_system_prompt_never_leaks_the_template(tokenizer):
    messages = [{"role": "system", "content": "SECRET rules: be brief."}, {"role": "user", "content": "héllo 日本"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    rng = random.Random(4)
    params = SamplingParams(temperature=0, max_tokens=40)
    for _ in range(20):
        ids = random_ids(rng, tokenizer, 40)
        want = summary(engine_stream(tokenizer, prompt, ids, params))
        for k in range(1, 40):
            got = summary(seamed_stream(tokenizer, prompt, ids, params, [k]))
            assert got == want and ("SECRET" in got[0]) == ("SECRET" in want[0]), k


def test_a_cold_detokenizer_at_the_seam_is_wrong(tokenizer):
    """Why ``SeamText`` exists: a new engine detokenizes prompt + delivered tokens from a cold
    start; when the delivered tokens end inside a character its output re-reads the prompt
    (in chat: the rendered template, system prompt included). If this ever passes with the
    cold detokenizer, vLLM fixed it upstream."""
    messages = [{"role": "system", "content": "SECRET rules"}, {"role": "user", "content": "hi"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    rng = random.Random(5)
    params = SamplingParams(temperature=0, max_tokens=30)
    leaked = wrong = 0
    for _ in range(20):
        ids = random_ids(rng, tokenizer, 30)
        want = summary(engine_stream(tokenizer, prompt, ids, params))[0]
        for k in range(1, 30):
            first = "".join(s[0] for s in engine_stream(tokenizer, prompt, ids, params, upto=k))
            cold = "".join(s[0] for s in engine_stream(tokenizer, prompt + ids[:k], ids[k:], params))
            wrong += first + cold != want
            leaked += "SECRET" in cold and "SECRET" not in want
    assert wrong > 0 and leaked > 0, (wrong, leaked)


def test_a_delivered_text_that_does_not_replay_is_refused(tokenizer):
    from supervisor.continuation import NotContinuable

    prompt = tokenizer.encode("Hi", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=8)
    ids = tokenizer.encode(" fox", add_special_tokens=False)
    with pytest.raises(NotContinuable, match="does not replay"):
        SeamText(new_detokenizer(tokenizer, prompt, params, "r"), ids, "something else")


def reference_logprobs(tok, positions, detokenize=True):
    """vLLM's own ``LogprobsProcessor`` fed ``positions`` ([sampled, alt1, alt2], values, rank)
    one step at a time, as the engine's output processor is (no tokenizer: ``detokenize=False``)."""
    import numpy as np
    from vllm.v1.engine.logprobs import LogprobsProcessor

    p = LogprobsProcessor(tokenizer=tok if detokenize else None, logprobs=[], prompt_logprobs=None,
                          cumulative_logprob=0.0, num_logprobs=2, num_prompt_logprobs=None)
    for ids, values, rank in positions:
        p._update_sample_logprobs(([np.array(ids)], [np.array(values)], [np.array(rank)], None))
    return p.logprobs, p.cumulative_logprob


def test_logprobs_across_every_seam_are_the_fault_free_ones(tokenizer):
    """For every seam position of a byte-level sequence: the new engine's logprobs (values, no
    token strings) through ``SeamLogprobs`` equal a fault-free run's: the same token strings
    (byte-fallback pieces completed with the delivered tokens as context), values, ranks, and
    the cumulative logprob carried on."""
    from executor.engine import logprob_token_strings
    from supervisor.continuation import SeamLogprobs

    rng = random.Random(11)
    # real text whose multi-byte characters the byte-level tokenizer splits across tokens
    sampled = tokenizer.encode("naïve café, 日本語の文 🙂 über straße", add_special_tokens=False)
    positions = [([t, rng.randrange(3, tokenizer.vocab_size), rng.randrange(3, tokenizer.vocab_size)],
                  [-rng.random(), -1.5, -2.5], rng.randrange(1, 4)) for t in sampled]
    whole, whole_cumulative = reference_logprobs(tokenizer, positions)
    assert any(any(lp.decoded_token == "" or "\ufffd" in tokenizer.decode([t]) for t, lp in p.items()) for p in whole)
    corrected = 0
    for k in range(1, len(sampled)):
        before, cumulative_before = reference_logprobs(tokenizer, positions[:k])
        new, running = reference_logprobs(tokenizer, positions[k:], detokenize=False)  # the new engine's
        assert all(lp.decoded_token is None for p in new for lp in p.values())
        seam = SeamLogprobs(logprob_token_strings, tokenizer, sampled[:k], cumulative_before)
        got, cumulative = seam.step(new, sampled[k:], running)
        assert before + got == whole, k
        assert abs(cumulative - whole_cumulative) < 1e-9
        # the naive way (each token decoded alone, as the front would without token strings) differs
        naive = [tokenizer.decode([t]) for p in new for t in p]
        corrected += naive != [lp.decoded_token for p in got for lp in p.values()]
    assert corrected > 0  # the context mattered at some seams
