"""Build a tiny, random-weight Llama model for demos and tests.

The model produced here is *noise*: its weights are random (from a fixed
seed) and its tokenizer is a byte-level BPE trained on a few paragraphs of
text embedded below.  Its outputs are meaningless strings of tokens.  It
exists so the supervisor can bring up a real vLLM engine offline (no Hugging
Face hub access) in a few seconds on a CPU, with deterministic output.

Greedy decoding is made robust against numerical noise from different
batching / prefill-vs-decode layouts by scaling the ``lm_head`` weights up,
which spreads the logits far apart (large argmax margins).

Importing this module is cheap: torch, transformers and tokenizers are
imported lazily inside :func:`build_demo_model`.  The module does not log;
callers log the returned path themselves.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import time
import uuid

__all__ = ["DEMO_MODEL_VERSION", "MARKER_FILE", "build_demo_model"]

# Bump whenever anything in the recipe below changes (architecture, seed,
# scaling, corpus, tokenizer settings, chat template ...).  A new version is
# built into a new directory; old ones are left alone.
DEMO_MODEL_VERSION = "1"

# Written last into the build directory; its presence means "complete".
MARKER_FILE = ".demo-model-complete"

_TMP_PREFIX = ".demo-model-tmp-"
_STALE_PREFIX = ".demo-model-stale-"
# Temp/stale directories older than this are assumed abandoned (crashed
# builder) and removed opportunistically.
_STALE_AGE_S = 3600.0

_SEED = 0
_VOCAB_SIZE = 512
_MAX_LEN = 1024
# Multiplier applied to the randomly initialised lm_head weight (init std
# 0.02) so that logits have a std of roughly 0.02 * sqrt(128) * 40 ~ 9.
_LM_HEAD_SCALE = 40.0

_BOS, _EOS, _PAD = "<s>", "</s>", "<pad>"

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A supervisor watches over "
    "a worker process, restarts it when it fails, and reports its health to "
    "anyone who asks. It keeps a careful log of every event, so that the "
    "operators can understand what happened after the fact.",
    "Once upon a time there was a small language model that lived inside a "
    "test suite. It knew only a handful of words and could not tell a story, "
    "but it always answered the same way when asked the same question. The "
    "engineers liked it for that reason: it was fast, cheap, and predictable.",
    "Requests arrive over the network and wait in a queue. The scheduler "
    "groups them into batches, the engine runs the model on each batch, and "
    "the tokens stream back to the clients one by one. When the engine is "
    "overloaded, new requests are rejected politely instead of timing out.",
    "Hello! How are you today? I am fine, thank you. What is the weather "
    "like where you live? It is sunny and warm here, with a light wind from "
    "the west. Tomorrow it may rain, so remember to bring an umbrella.",
    "Numbers and symbols appear in text too: 0 1 2 3 4 5 6 7 8 9, 10, 42, "
    "100, 2024, 3.14, and 1,000,000. Code looks like this: def main(): "
    "return {\"status\": \"ok\", \"count\": 3} # done.",
    "The user asked a question and the assistant gave an answer. The system "
    "message described the rules of the conversation. Each message has a "
    "role and some content, and the chat template joins them together into "
    "a single prompt for the model to continue.",
]


def build_demo_model(data_dir: pathlib.Path) -> pathlib.Path:
    """Return the path of the demo model directory, building it if needed.

    The model is cached under ``data_dir / f"demo-model-{DEMO_MODEL_VERSION}"``.
    Building happens in a temporary directory next to it, which is renamed
    into place atomically once complete, so concurrent builders or crashes
    never leave a half-written model at the final path.  If another builder
    wins the race, its result is used.
    """
    data_dir = pathlib.Path(data_dir)
    final = data_dir / f"demo-model-{DEMO_MODEL_VERSION}"
    if (final / MARKER_FILE).is_file():
        return final

    data_dir.mkdir(parents=True, exist_ok=True)
    _cleanup_abandoned(data_dir)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=data_dir))
    try:
        # mkdtemp creates 0700; give the published dir ordinary permissions
        # (not via os.umask(), which is process-global and racy).
        os.chmod(tmp, 0o755)
        _build_into(tmp)
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _publish(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Atomically move the finished build ``tmp`` to ``final``."""
    for _ in range(3):
        if (final / MARKER_FILE).is_file():
            return  # someone else finished first; use theirs
        if final.exists():
            # Incomplete leftover (e.g. written by something non-atomic):
            # move it aside atomically, then delete it.
            stale = final.parent / f"{_STALE_PREFIX}{uuid.uuid4().hex}"
            try:
                os.rename(final, stale)
            except OSError:
                pass  # another builder moved/replaced it; re-check
            else:
                shutil.rmtree(stale, ignore_errors=True)
            continue
        try:
            os.rename(tmp, final)
            return
        except OSError:
            continue  # lost the race; re-check for a complete model
    if not (final / MARKER_FILE).is_file():
        raise RuntimeError(f"could not publish demo model to {final}")


def _cleanup_abandoned(data_dir: pathlib.Path) -> None:
    now = time.time()
    for entry in data_dir.iterdir():
        if not entry.name.startswith((_TMP_PREFIX, _STALE_PREFIX)):
            continue
        try:
            if now - entry.stat().st_mtime > _STALE_AGE_S:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


def _build_into(out: pathlib.Path) -> None:
    from transformers.utils import logging as hf_logging

    # Keep "Writing model shards" progress bars out of daemon logs.
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        _build_files(out)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()

    for f in out.iterdir():
        os.chmod(f, 0o644)  # safetensors writes 0600

    # Marker last: its presence means every other file is complete.
    marker = out / MARKER_FILE
    with open(marker, "w", encoding="utf-8") as f:
        json.dump({"version": DEMO_MODEL_VERSION}, f)
        f.flush()
        os.fsync(f.fileno())


def _build_files(out: pathlib.Path) -> None:
    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(str(out), save_jinja_files=False)

    bos_id = tokenizer.convert_tokens_to_ids(_BOS)
    eos_id = tokenizer.convert_tokens_to_ids(_EOS)
    pad_id = tokenizer.convert_tokens_to_ids(_PAD)
    if len(tokenizer) > _VOCAB_SIZE:
        raise RuntimeError(f"demo tokenizer too large: {len(tokenizer)}")

    _build_weights(out, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[_BOS, _EOS, _PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        model_max_length=_MAX_LEN,
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def _build_weights(out: pathlib.Path, *, bos_id: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim = 128 / 4 = 32 (vLLM CPU needs >= 32)
        intermediate_size=256,
        vocab_size=_VOCAB_SIZE,
        max_position_embeddings=_MAX_LEN,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )

    torch.manual_seed(_SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(_LM_HEAD_SCALE)
    model.eval()

    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=False,
    )
    model.save_pretrained(str(out), safe_serialization=True)
