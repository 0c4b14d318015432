"""Inside a worker: what a continued request generated before the seam is still its past.

A request continued after a seam reaches the new engine as prompt + delivered tokens, with the
delivered ids in ``SamplingParams.extra_args[RESUME_IDS_KEY]`` (``executor.resume``). Two parts
of the worker's sampler depend on what the request generated before, and would start over:

* presence and frequency penalties and ``bad_words`` read the request's output tokens (the
  repetition penalty reads prompt ∪ output, which prompt + delivered already covers);
* a seeded request's random stream (``CachedRequestState.generator``) would restart at its seed.

When the worker creates the request's state (``CachedRequestState.__post_init__``), the output
list it keeps (appended in place, step by step) becomes a ``Delivered`` list that also holds the
delivered tokens; the sampler's bad-words and penalty steps read delivered + output for such a
row. The generator makes, at once, the draws the failed engine's sampler made for the delivered
tokens: on CPU one ``randint`` per step (``topk_topp_sampler.forward_cpu``). The supervisor does
not continue a seeded request on another sampler (``replay_refusal``).

Installed in every worker of the Ray executors (``install``); a no-op for other requests. The
structures it wraps are the V1 model runner's (the CPU runner's, and a GPU's with
``VLLM_USE_V2_MODEL_RUNNER=0``): with vLLM's V2 model runner, its default on GPUs, the supervisor
does not continue the requests that need it (``history_refusal``).
"""

from __future__ import annotations

from typing import Any

from executor.resume import RESUME_IDS_KEY

_installed = False


class Delivered(list):
    """A continued request's output token ids in the worker (vLLM's own list, appended in
    place) that also knows the tokens delivered before the seam."""

    def __init__(self, items: Any, delivered: list[int]):
        super().__init__(items)
        self.delivered = list(delivered)


def with_history(output_token_ids: list[list[int]]) -> list[list[int]]:
    """The sampler's per-row output tokens, delivered + output for a continued request's row
    (the same list object when there is none)."""
    if not any(type(o) is Delivered for o in output_token_ids):
        return output_token_ids
    return [[*o.delivered, *o] if type(o) is Delivered else o for o in output_token_ids]


def delivered_ids(sampling_params: Any) -> list[int]:
    return list((getattr(sampling_params, "extra_args", None) or {}).get(RESUME_IDS_KEY) or ())


def advance(generator: Any, steps: int) -> None:
    """Make the draws the CPU sampler makes for ``steps`` sampled tokens of one request (one
    ``randint(0, 2**31)`` each; drawn together, the same numbers in the same order)."""
    import torch

    if generator.device.type != "cpu":  # the supervisor does not send one (replay_refusal)
        raise RuntimeError(f"a seeded request's random stream is replayed on CPU only, not {generator.device}")
    if steps > 0:
        torch.randint(0, 2**31, (steps,), generator=generator, dtype=torch.long)


def carry(state: Any) -> None:
    """A new request's worker state, brought to where the failed engine's stopped."""
    delivered = delivered_ids(state.sampling_params)
    if not delivered:
        return
    state.output_token_ids = Delivered(state.output_token_ids, delivered)
    if state.generator is not None:
        advance(state.generator, len(delivered))
    state.__class__ = _resumed_class(type(state))


_resumed: dict[type, type] = {}


def _resumed_class(cls: type) -> type:
    """``cls`` whose output list keeps its history when vLLM replaces it (async scheduling
    sets a fresh list for a request resumed from preemption)."""
    if cls not in _resumed:

        def __setattr__(self: Any, name: str, value: Any) -> None:
            if name == "output_token_ids" and type(value) is not Delivered:
                value = Delivered(value, self.__dict__["output_token_ids"].delivered)
            object.__setattr__(self, name, value)

        _resumed[cls] = type(f"Resumed{cls.__name__}", (cls,), {"__setattr__": __setattr__})
    return _resumed[cls]


def replay_refusal(vllm_config: Any) -> str | None:
    """Why a seeded request's random stream cannot be replayed on engines of ``vllm_config``
    (None: it can)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ("its random stream is replayed on the CPU sampler only (the GPU sampler's is "
                "not, docs/known-limits.md)")
    if getattr(getattr(vllm_config, "model_config", None), "use_fp64_gumbel", False):
        return "its random stream is not replayed with use_fp64_gumbel"
    return None


def history_refusal(vllm_config: Any) -> str | None:
    """Why the workers of engines of ``vllm_config`` do not carry a continued request's past
    (None: they do)."""
    backend = getattr(getattr(vllm_config, "parallel_config", None), "distributed_executor_backend", None)
    if backend == "mp" or getattr(backend, "__name__", "") == "SupervisedMultiprocExecutor":
        return "the mp executor's workers do not carry a continued request's past"
    try:
        v2 = bool(vllm_config.use_v2_model_runner)  # vLLM's default on GPUs (with Triton); never on CPU
    except Exception:  # noqa: BLE001 (a config without one: the V1 model runner)
        v2 = False
    if v2:
        return "the V2 model runner (vLLM's default on GPUs) does not carry a continued request's past"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "with speculative decoding a continued request's past is not carried"
    return None


def install() -> None:
    """Wrap, in this worker process, where vLLM creates a request's state and where its
    sampler reads output tokens (once)."""
    global _installed
    if _installed:
        return
    from vllm.v1.sample import sampler
    from vllm.v1.worker import gpu_input_batch

    state_cls = gpu_input_batch.CachedRequestState
    post_init = state_cls.__post_init__

    def __post_init__(self: Any) -> None:
        post_init(self)
        carry(self)

    state_cls.__post_init__ = __post_init__

    bad_words = sampler.apply_bad_words
    sampler.apply_bad_words = lambda logits, ids, past: bad_words(logits, ids, with_history(past))

    penalties = sampler.Sampler.apply_penalties

    def apply_penalties(logits: Any, sampling_metadata: Any, output_token_ids: Any) -> Any:
        if sampling_metadata.no_penalties:
            return logits
        return penalties(logits, sampling_metadata, with_history(output_token_ids))

    sampler.Sampler.apply_penalties = staticmethod(apply_penalties)
    _installed = True
