"""Tests for dapo_core.compute.models: char tokenizer, chat template, tiny model build/load."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from dapo_core.compute.models import (
    EOS_TOKEN,
    PAD_TOKEN,
    ModelConfigError,
    build_char_tokenizer,
    build_tiny_model,
    load_model,
    load_tokenizer,
    tokenizer_dir,
)
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

TINY = tiny_model_cfg(hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=128)
TEXT = "Solve:  2 + 3 = ?\n\nAnswer: 5\t~{}|\\  end "


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TINY, seed=3)


def test_char_tokenizer_round_trip_keeps_whitespace():
    tok = build_char_tokenizer()
    text = TEXT.replace("\t", " ")
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text


def test_special_tokens_and_ids():
    tok = build_char_tokenizer()
    assert (tok.pad_token, tok.eos_token) == (PAD_TOKEN, EOS_TOKEN)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok.encode("a<|im_end|>b")
    assert ids == [tok.convert_tokens_to_ids("a"), 2, tok.convert_tokens_to_ids("b")]
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    assert tok.decode(tok.encode("é")) == "<|unk|>"  # outside printable ASCII


def test_chat_template_chatml():
    tok = build_char_tokenizer()
    msgs = [{"role": "user", "content": "What is 1+1?\nThink."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 1+1?\nThink.<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids
    assert tok.decode(ids) == text
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert not no_gen.endswith("assistant\n")


def test_saved_tokenizer_is_char_level_not_qwen2(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    text = "x  y\n z"
    assert tok.decode(tok.encode(text)) == text
    assert tok.chat_template is not None
    # The copy in tokenizer/ is safe for AutoTokenizer users (e.g. vLLM).
    auto = AutoTokenizer.from_pretrained(str(tokenizer_dir(tiny_dir)))
    assert auto.decode(auto.encode(text)) == text
    assert auto.encode(text) == tok.encode(text)


def test_build_tiny_model_config_and_determinism(tiny_dir, tmp_path):
    model = load_model(tiny_dir)
    cfg = model.config
    tok = load_tokenizer(tiny_dir)
    assert cfg.model_type == "qwen2" and cfg.vocab_size == len(tok)
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads) == (32, 32, 1)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (2, 0, 1)
    assert (tiny_dir / "model.safetensors").is_file()
    again = load_model(build_tiny_model(tmp_path / "again", TINY, seed=3))
    other = load_model(build_tiny_model(tmp_path / "other", TINY, seed=4))
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert any(not torch.equal(a, c) for a, c in zip(model.parameters(), other.parameters(), strict=True))


def test_build_tiny_model_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    build_tiny_model(tmp_path, TINY, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_load_model_float64(tiny_dir):
    m32 = load_model(tiny_dir)
    m64 = load_model(tiny_dir, dtype=torch.float64)
    assert next(m64.parameters()).dtype == torch.float64
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a = m32(input_ids=ids).logits.double()
        b = m64(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"head_dim": 16}, "head_dim"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_bad_tiny_config_names_the_key(tmp_path, patch, needle):
    with pytest.raises(ModelConfigError, match=needle):
        build_tiny_model(tmp_path, {**TINY, **patch}, seed=0)


def test_missing_tiny_key_and_missing_folder(tmp_path):
    cfg = dict(TINY)
    del cfg["head_dim"]
    with pytest.raises(ModelConfigError, match="head_dim"):
        build_tiny_model(tmp_path / "a", cfg, seed=0)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape("config.json")):
        load_model(tmp_path)
