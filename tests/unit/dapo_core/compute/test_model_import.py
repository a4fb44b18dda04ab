"""`dapo import-model`: the packaged SmolLM2 GGUF becomes an ordinary HF folder; bad inputs are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_core.compute import model_import as mi
from dapo_core.errors import DapoUserError

gguf = pytest.importorskip("gguf", reason="gguf is installed by `make setup`")


def _tiny_gguf(path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    import numpy as np

    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_file_and_non_gguf_are_one_paragraph(tmp_path):
    with pytest.raises(DapoUserError, match="does not exist") as e:
        mi.import_gguf(tmp_path / "out", tmp_path / "nope.gguf")
    assert "\n" not in str(e.value)
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(DapoUserError, match="not a readable GGUF"):
        mi.import_gguf(tmp_path / "out", bad)
    assert not (tmp_path / "out").exists()


def test_other_architectures_are_refused_before_any_weight_is_read(tmp_path):
    src = _tiny_gguf(tmp_path / "m.gguf", "gpt2")
    assert mi.gguf_metadata(src)["architecture"] == "gpt2"
    with pytest.raises(DapoUserError, match="`gpt2` model; the importer converts only llama") as e:
        mi.import_gguf(tmp_path / "out", src)
    assert "Fix:" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_sha256_of_a_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    assert mi.sha256_file(p) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.slow
def test_smollm2_imports_to_an_hf_folder_that_loads_and_generates(smollm2):
    import torch

    from dapo_core.compute.models import load_model, load_tokenizer

    out, src = smollm2, mi.find_packaged_gguf()
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == 49152 and cfg["num_hidden_layers"] == 30 and cfg["tie_word_embeddings"]
    rec = json.loads((out / "import.json").read_text())
    assert rec["source"]["sha256"] == mi.sha256_file(src) and rec["gguf"]["tensor_types"]["Q4_1"] > 0
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    tok = load_tokenizer(out)
    assert (
        tok.eos_token == "<|im_end|>"
        and tok.pad_token == "<|endoftext|>"
        and tok.pad_token_id != tok.eos_token_id
    )
    text = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n2+2?<|im_end|>" in text
    model = load_model(out)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids["input_ids"].shape[1]
    assert tok.decode(gen[0, ids["input_ids"].shape[1] :]).strip()
