"""The model's shape (the sizes memory depends on), where the plan finds it, and byte sizes: `ModelShape`,
`resolve_shape`, the built-in shapes, `parse_bytes` and the bytes per value of each dtype name; `LoraShape`,
the LoRA adapters' sizes (`lora_shape`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1 << 30


class PlanError(ValueError):
    """The plan cannot be made (no model shape, bad size); the message names the input and the fix."""


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
_DTYPE_NAMES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only (Qwen2/Llama-style) model that memory depends on."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    dtype_bytes: int
    """Bytes per value of the checkpoint's `torch_dtype` (what vLLM serves)."""
    source: str
    """Where the shape came from (a config.json path, a built-in entry with its reference, the tiny model)."""
    qkv_bias: bool = True
    """q, k, v projections carry biases (Qwen2; Llama's `attention_bias` is false)."""

    @property
    def kv_dim(self) -> int:
        """Width of k (and of v): kv heads × head dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v (with biases in Qwen2), o, gate/up/down, two RMSNorms."""
        h, kv, i, q = (
            self.hidden_size,
            self.kv_dim,
            self.intermediate_size,
            self.num_attention_heads * self.head_dim,
        )
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * q + 2 * h * kv + bias + q * h + 3 * h * i + 2 * h

    @property
    def embedding_params(self) -> int:
        """Input embedding (V × h); the LM head is the same tensor when tied."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: embedding, layers, final norm, LM head unless tied."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_hidden_layers * self.layer_params + self.hidden_size + head

    @property
    def largest_params(self) -> int:
        """Elements of the largest single tensor: the embedding V·h (the LM head is as large), or a layer's
        gate/up i·h, q/o h·q."""
        q = self.num_attention_heads * self.head_dim
        return max(self.embedding_params, self.intermediate_size * self.hidden_size, q * self.hidden_size)

    @property
    def num_tensors(self) -> int:
        """Distinct tensors of the state dict: per layer q, k, v (and their biases), o, gate, up, down, two
        norms; the embedding, the final norm and the LM head unless tied."""
        per_layer = 9 + (3 if self.qkv_bias else 0)
        return self.num_hidden_layers * per_layer + 2 + (0 if self.tie_word_embeddings else 1)

    @classmethod
    def from_config_json(cls, path: str | Path, source: str | None = None) -> ModelShape:
        """Read an HF config.json (Qwen2/Llama keys)."""
        p = Path(path)
        try:
            c = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(
                f"{p}: cannot read a model config.json ({e}); pass --model-config <config.json>."
            ) from e
        missing = [
            k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in c
        ]
        if missing:
            raise PlanError(f"{p} lacks {missing}; is it a decoder-only HF config.json?")
        heads = int(c["num_attention_heads"])
        dtype = str(c.get("torch_dtype") or c.get("dtype") or "float32")
        return cls(
            hidden_size=int(c["hidden_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            vocab_size=int(c["vocab_size"]),
            intermediate_size=int(c.get("intermediate_size") or 4 * int(c["hidden_size"])),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            dtype_bytes=_DTYPE_BYTES.get(dtype, 4),
            source=source or str(p),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type", "qwen2") == "qwen2")),
        )


BUILTIN_SHAPES: dict[str, ModelShape] = {
    "Qwen2.5-32B": ModelShape(
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=152064,
        intermediate_size=27648,
        tie_word_embeddings=False,
        dtype_bytes=2,
        source="built-in Qwen2.5-32B (huggingface.co/Qwen/Qwen2.5-32B config.json)",
    ),
    "Qwen2.5-0.5B": ModelShape(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151936,
        intermediate_size=4864,
        tie_word_embeddings=True,
        dtype_bytes=2,
        source="built-in Qwen2.5-0.5B (huggingface.co/Qwen/Qwen2.5-0.5B config.json)",
    ),
}
"""Shapes of models the shipped configs name, for when the weights are not on this machine."""
CHAR_VOCAB = 100
"""Vocabulary of the embedded character tokenizer (4 specials + 95 printable ASCII + newline)."""


def resolve_shape(cfg: Any, model_config: str | None = None) -> ModelShape:
    """The model shape: `model_config` (a config.json), else the model folder's config.json, else the
    built-in entry whose name the model path ends with, else the tiny model of `model.tiny` when the path
    is empty."""
    if model_config:
        return ModelShape.from_config_json(model_config)
    model = cfg.actor_rollout_ref.model
    path = str(model.path or "")
    if not path:
        t = model.tiny
        return ModelShape(
            hidden_size=int(t.hidden_size),
            num_hidden_layers=int(t.num_hidden_layers),
            num_attention_heads=int(t.num_attention_heads),
            num_key_value_heads=int(t.num_key_value_heads),
            head_dim=int(t.head_dim),
            vocab_size=CHAR_VOCAB,
            intermediate_size=int(t.intermediate_size),
            tie_word_embeddings=bool(t.tie_word_embeddings),
            dtype_bytes=4,
            source="the embedded tiny model (actor_rollout_ref.model.tiny)",
        )
    if (Path(path) / "config.json").is_file():
        return ModelShape.from_config_json(Path(path) / "config.json")
    name = path.rstrip("/").rsplit("/", 1)[-1]
    for key, shape in BUILTIN_SHAPES.items():
        if name.lower() == key.lower():
            return shape
    raise PlanError(
        f"actor_rollout_ref.model.path={path!r} has no config.json here and is not a built-in shape "
        f"({sorted(BUILTIN_SHAPES)}); pass --model-config <its config.json>."
    )


@dataclass(frozen=True)
class LoraShape:
    """The sizes of the LoRA adapters of `actor_rollout_ref.model`'s `lora_rank`, `target_modules` and
    `exclude_modules` on a `ModelShape`: r·(in + out) per adapted linear layer."""

    rank: int
    params: int
    """Adapter parameters of the whole model (A: r × in, B: out × r per adapted layer)."""
    layer_params: int
    """Adapter parameters of the decoder layer with the most."""
    largest_adapted: int
    """Elements of the largest adapted base weight (merged into a new tensor for a push)."""
    adapted: int
    """Adapted linear layers of the model."""
    base_params: int
    """Elements of the adapted base weights (merged with their adapters for a push)."""
    a_params: int
    """Elements of the A matrices (r × in each): what an FSDP2 rank gathers whole to merge its rows."""


def _linears(s: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of a decoder layer's linear layers by their module path below the layer."""
    h, kv, i, q = s.hidden_size, s.kv_dim, s.intermediate_size, s.num_attention_heads * s.head_dim
    return {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }


def _matches(key: str, names: Any) -> bool:
    """peft's module matching: a regex string matches the whole module path; a name of a list matches a
    path equal to it or ending with `.name`."""
    if isinstance(names, str):
        return re.fullmatch(names, key) is not None
    return any(key == n or key.endswith("." + n) for n in names)


def lora_shape(s: ModelShape, model_cfg: Any) -> LoraShape | None:
    """The adapters `lora.add_lora` builds for `model_cfg` (`actor_rollout_ref.model`) on `s`; None when
    `lora_rank` is 0. `all-linear` is what peft makes of it: every linear layer of the decoder layers (q, k,
    v, o, gate, up, down), not the LM head (peft leaves the output layer out) nor the embedding; a list
    names modules as peft matches them, and may add `lm_head`."""
    rank = int(getattr(model_cfg, "lora_rank", 0) or 0)
    if rank <= 0:
        return None
    targets = getattr(model_cfg, "target_modules", "all-linear")
    excl = getattr(model_cfg, "exclude_modules", None)
    if not isinstance(targets, str):
        targets = list(targets)
    if excl is not None and not isinstance(excl, str):
        excl = list(excl)
    modules = {
        f"model.layers.{layer}.{name}": dims
        for layer in range(s.num_hidden_layers)
        for name, dims in _linears(s).items()
    }
    modules["lm_head"] = (s.hidden_size, s.vocab_size)
    per_layer: dict[str, int] = {}
    total = largest = adapted = base = a_total = 0
    for key, (n_in, n_out) in modules.items():
        wanted = key != "lm_head" if targets == "all-linear" else _matches(key, targets)
        if not wanted or (excl is not None and _matches(key, excl)):
            continue
        total += rank * (n_in + n_out)
        largest = max(largest, n_in * n_out)
        base += n_in * n_out
        a_total += rank * n_in
        adapted += 1
        layer = key.rsplit(".", 2)[0] if key != "lm_head" else key
        per_layer[layer] = per_layer.get(layer, 0) + rank * (n_in + n_out)
    layer_max = max((v for k, v in per_layer.items() if k != "lm_head"), default=0)
    return LoraShape(rank, total, layer_max, largest, adapted, base, a_total)


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '141G', '512MiB' or a plain number of bytes -> bytes (GB and G are taken as GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise PlanError(f"--gpu-mem {text!r} is not a size; write e.g. 80GiB or 141GiB.")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"
