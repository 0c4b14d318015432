"""Unit tests for supervisor.demo_model (no vLLM import; a few seconds)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from supervisor import demo_model
from supervisor.demo_model import DEMO_MODEL_VERSION, MARKER_FILE, build_demo_model

EXPECTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    data_dir = tmp_path_factory.mktemp("data")
    return data_dir, build_demo_model(data_dir)


@pytest.fixture(scope="module")
def tokenizer(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(built[1]), local_files_only=True)


def test_files_exist_at_versioned_path(built):
    data_dir, path = built
    assert path == data_dir / f"demo-model-{DEMO_MODEL_VERSION}"
    for name in EXPECTED_FILES:
        assert (path / name).is_file(), name
    # No temp/stale build directories left behind.
    assert [p.name for p in data_dir.iterdir()] == [path.name]


def test_config_values(built, tokenizer):
    cfg = json.loads((built[1] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == 128
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 4
    assert cfg["num_key_value_heads"] == 2
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 32
    assert cfg.get("head_dim", 32) == 32
    assert cfg["intermediate_size"] == 256
    assert cfg["vocab_size"] == 512
    assert cfg["max_position_embeddings"] == 1024
    assert cfg["tie_word_embeddings"] is False
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    assert cfg["bos_token_id"] == tokenizer.bos_token_id
    assert cfg["eos_token_id"] == tokenizer.eos_token_id
    assert cfg["pad_token_id"] == tokenizer.pad_token_id
    gen = json.loads((built[1] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id
    assert gen.get("do_sample", False) is False


def test_weights_untied_and_lm_head_scaled(built):
    from safetensors import safe_open

    with safe_open(str(built[1] / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" in keys
        assert "model.embed_tokens.weight" in keys
        lm_head = f.get_tensor("lm_head.weight")
        embed = f.get_tensor("model.embed_tokens.weight")
    assert tuple(lm_head.shape) == (512, 128)
    assert str(lm_head.dtype) == "torch.float32"
    # lm_head was scaled far above the 0.02 init std.
    assert lm_head.std().item() > 10 * embed.std().item()


def test_tokenizer_round_trip(tokenizer):
    assert len(tokenizer) <= 512
    assert tokenizer.bos_token == "<s>"
    assert tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token == "<pad>"
    assert tokenizer.model_max_length == 1024
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert len(ids) == 3 and max(ids) < 512
    for text in (
        "Hello! How are you today?",
        "The quick brown fox jumps over the lazy dog.",
        "Unseen words: zyzzyva, 12345, été, 你好, emoji \U0001f600\n\ttabs",
    ):
        enc = tokenizer.encode(text, add_special_tokens=False)
        assert enc and max(enc) < 512
        assert tokenizer.decode(enc) == text
    # BPE merges were learned: common corpus text compresses below 1 token/byte.
    text = "The quick brown fox jumps over the lazy dog."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) // 2


def test_chat_template(built, tokenizer):
    cfg = json.loads((built[1] / "tokenizer_config.json").read_text())
    assert cfg.get("chat_template") or (built[1] / "chat_template.jinja").is_file()
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    no_prompt = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert no_prompt == "<|system|>\nBe brief.\n<|user|>\nHi there\n"


def test_second_call_uses_cache(built, monkeypatch):
    data_dir, path = built
    before = {n: os.stat(path / n).st_mtime_ns for n in EXPECTED_FILES}

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(demo_model, "_build_into", fail)
    assert build_demo_model(data_dir) == path
    assert {n: os.stat(path / n).st_mtime_ns for n in EXPECTED_FILES} == before


def test_incomplete_directory_is_replaced(tmp_path, built, monkeypatch):
    # A directory at the final path without the marker (e.g. a partial copy)
    # must not be trusted; it is replaced by a complete build.
    final = tmp_path / f"demo-model-{DEMO_MODEL_VERSION}"
    final.mkdir()
    (final / "config.json").write_text("{}")

    def fake_build(out: pathlib.Path) -> None:
        for name in EXPECTED_FILES:
            (out / name).write_bytes((built[1] / name).read_bytes())

    monkeypatch.setattr(demo_model, "_build_into", fake_build)
    assert build_demo_model(tmp_path) == final
    assert (final / MARKER_FILE).is_file()
    assert json.loads((final / "config.json").read_text())["vocab_size"] == 512
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(out: pathlib.Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(demo_model, "_build_into", boom)
    with pytest.raises(RuntimeError, match="boom"):
        build_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_import_is_cheap():
    root = pathlib.Path(os.path.abspath(demo_model.__file__)).parent.parent
    code = (
        "import sys, supervisor.demo_model\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run(
        [sys.executable, "-c", code], check=True, env=env, cwd=root, timeout=60
    )
