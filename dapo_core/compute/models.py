"""Tiny models and the character-level tokenizer used on CPU, plus HF load/save helpers.

`build_char_tokenizer()` makes a character-level WordLevel tokenizer (printable ASCII and newline,
one token per character, ChatML special tokens) so that decode(encode(s)) == s exactly.
`build_tiny_model()` writes a randomly initialised `Qwen2ForCausalLM` and that tokenizer into one HF
folder that both `load_tokenizer` and vLLM can read.

Tokenizer trap (transformers 5, docs/STACK_NOTES.md): `AutoTokenizer.from_pretrained(folder)` on a folder
whose config.json says `qwen2` swaps in Qwen2's byte-level tokenizer and silently drops spaces and newlines.
Therefore `load_tokenizer` always uses `PreTrainedTokenizerFast` on `tokenizer.json`, and every saved model
folder also carries a copy of the tokenizer in `<folder>/tokenizer/` (no config.json there), which
`AutoTokenizer` — e.g. vLLM's `tokenizer=` argument — loads correctly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from dapo_core.compute.tokenizer import TOKENIZER_SUBDIR, load_tokenizer, tokenizer_dir

__all__ = [
    "BOS_TOKEN",
    "CHATML_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "TOKENIZER_SUBDIR",
    "UNK_TOKEN",
    "ModelConfigError",
    "build_char_tokenizer",
    "build_tiny_model",
    "copy_model_files",
    "load_model",
    "load_tokenizer",
    "require_hf_folder",
    "save_model",
    "tokenizer_dir",
]

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: `<|im_start|>role\ncontent<|im_end|>\n` per message, then `<|im_start|>assistant\n`."""

_TINY_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
)


class ModelConfigError(ValueError):
    """A tiny-model size or a model folder is wrong; the message names the key and the fix."""


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Return a character-level tokenizer over printable ASCII (32..126) and `\\n` with ChatML specials.

    Ids: 0 `<|endoftext|>` (pad), 1 `<|im_start|>` (bos), 2 `<|im_end|>` (eos), 3 `<|unk|>`, then one id
    per character. Special tokens written literally in text are recognised as single tokens.
    """
    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character is its own pre-token ([\s\S] also matches newlines); Fuse joins them back verbatim.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        model_max_length=1 << 30,
    )


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir / TOKENIZER_SUBDIR))


def save_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast | None,
    out_dir: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save `model` as HF safetensors (and `tokenizer`, also in `tokenizer/`) into `out_dir`; return the
    path. `state_dict` replaces the model's own weights in the file (same names: e.g. merged LoRA weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if state_dict is None:
        model.save_pretrained(str(out), safe_serialization=True)
    else:
        model.save_pretrained(str(out), safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, out)
    return out


def _tiny_config(tiny_cfg: Mapping[str, Any], tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    missing = [k for k in _TINY_KEYS if k not in tiny_cfg]
    if missing:
        raise ModelConfigError(
            f"actor_rollout_ref.model.tiny is missing {missing}; set them (e.g. hidden_size=64, "
            "intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, "
            "head_dim=32, max_position_embeddings=1024, tie_word_embeddings=true)."
        )
    c = {k: tiny_cfg[k] for k in _TINY_KEYS}
    for k in _TINY_KEYS[:-1]:
        if int(c[k]) < 1:
            raise ModelConfigError(f"actor_rollout_ref.model.tiny.{k}={c[k]} must be a positive integer.")
    if int(c["head_dim"]) < 32:
        raise ModelConfigError(
            f"actor_rollout_ref.model.tiny.head_dim={c['head_dim']} is below 32, which vLLM's CPU kernels "
            "reject; use 32 or 64."
        )
    if int(c["num_attention_heads"]) % int(c["num_key_value_heads"]) != 0:
        raise ModelConfigError(
            f"actor_rollout_ref.model.tiny.num_attention_heads={c['num_attention_heads']} is not a multiple "
            f"of num_key_value_heads={c['num_key_value_heads']}; pick a divisor."
        )
    return Qwen2Config(  # type: ignore[call-arg]  # the stubs list only a subset of the config kwargs
        vocab_size=len(tokenizer),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_hidden_layers=int(c["num_hidden_layers"]),
        num_attention_heads=int(c["num_attention_heads"]),
        num_key_value_heads=int(c["num_key_value_heads"]),
        head_dim=int(c["head_dim"]),
        max_position_embeddings=int(c["max_position_embeddings"]),
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,  # RoPE base, Qwen2's; not a config key
        torch_dtype="float32",
    )


def build_tiny_model(out_dir: str | Path, tiny_cfg: Mapping[str, Any], seed: int) -> Path:
    """Write a randomly initialised (from `seed`) tiny `Qwen2ForCausalLM` + char tokenizer to `out_dir`.

    `tiny_cfg` gives hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim (>= 32), max_position_embeddings and tie_word_embeddings.
    The same seed gives bitwise-identical weights. Returns the folder path.
    """
    tokenizer = build_char_tokenizer()
    config = _tiny_config(tiny_cfg, tokenizer)
    devices: list[int] = []  # fork the RNG so building a model does not disturb the caller's random stream
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out = save_model(model, tokenizer, out_dir)
    (out / "dapo_tiny.json").write_text(
        json.dumps({"seed": int(seed), "tiny": dict(config_subset(tiny_cfg))})
    )
    return out


def config_subset(tiny_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The tiny-model keys of `tiny_cfg` as plain Python values (for provenance files)."""
    return {k: (v if isinstance(v, (int, float, bool, str)) else str(v)) for k, v in tiny_cfg.items()}


MODEL_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    TOKENIZER_SUBDIR,
)
"""The tokenizer files of an HF model folder (the tokenizer also sits in its own sub-folder)."""


def copy_model_files(src: str | Path, out: str | Path) -> None:
    """Copy `MODEL_FILES` that exist in the model folder `src` into `out` (created if needed)."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        path = src / name
        if path.is_dir():
            shutil.copytree(path, out / name, dirs_exist_ok=True)
        elif path.is_file():
            shutil.copy2(path, out / name)


def require_hf_folder(path: str | Path) -> Path:
    """`path` as a Path, or `FileNotFoundError` naming the key to set when it holds no config.json."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{p} has no config.json; set actor_rollout_ref.model.path to an HF model folder "
            "(or build one with dapo_core.compute.models.build_tiny_model)."
        )
    return p


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> Any:
    """Load a causal LM from the HF folder `path` in `dtype` on `device`, in eval mode.

    Attention defaults to SDPA: transformers' eager attention turns left-padded rows into NaN in
    float64 (its mask value overflows), SDPA is exact in float32 and float64.
    """
    from transformers import AutoModelForCausalLM

    p = require_hf_folder(path)
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, attn_implementation=attn_implementation)
    model.to(device)  # type: ignore[arg-type]  # transformers types `to` through a decorator
    model.eval()
    return model
