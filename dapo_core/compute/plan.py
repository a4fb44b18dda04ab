"""`dapo plan`: a per-GPU memory estimate of every role of a config, checkable by hand.

What it models is what our code does (read from flows/run_setup.py and the engines):

- Placement: each model-holding role (rollout, actor, reference when a KL term needs it, critic when GAE needs
  it) is its own Ray actor asking for one GPU; roles never share a GPU. Training is one process per role, so
  the DeepSpeed data-parallel world is 1 (`trainer.nnodes` > 1 is refused; `n_gpus_per_node` only sizes the
  cluster). ZeRO then shards nothing; what saves GPU memory is offload. `--dp N` shows the reference's
  deployment (N ranks sharing the ZeRO partitions) as a what-if; it is not what `dapo train` runs.
- Actor: the torch engine trains in float32 (weights 4 B, gradients 4 B, AdamW m and v 8 B per parameter). The
  DeepSpeed engine with `bf16` holds bf16 weights and gradients (2 + 2 B) plus the fp32 master copy and m, v
  (12 B); without `bf16` it is 4 + 4 + 8 B. ZeRO stage s divides optimizer states (s >= 1), gradients (s >= 2)
  and weights (s = 3) by the dp world; `offload_optimizer` moves optimizer states (and, for s >= 2, the fp32
  gradient partitions) to the CPU; `offload_param` (s = 3) moves the weights to the CPU, leaving the gathered
  working set on the GPU, taken here as two decoder layers plus the embedding (a prefetch window).
- Reference: the torch engine in float32, forward only (no gradients, no optimizer).
- Critic: the policy's backbone plus a value head, torch AdamW in float32 (16 B per parameter).
- Rollout: vLLM reserves `gpu_memory_utilization` of each GPU for weights (split over
  `tensor_model_parallel_size`), activations and the KV cache; the KV cache is what is left. HF generate
  (CPU/tests) holds the weights and a KV cache for `gen_batch_size × n` full-length sequences.
- Activations of one micro-batch of N tokens (N = the token budget when `use_dynamic_bsz`, or the rows of a
  micro-batch × the padded width; a row longer than the budget goes alone): per decoder layer and token, the
  tensors autograd keeps are `8h + 4·kv + 4i` values (norm inputs/outputs, q, k, v, rotary q/k, attention
  output, MLP gate, up, activation and product). With gradient checkpointing each layer's input (h per
  layer) is kept, plus in backward one recomputed layer and its gradient working set. On CPU, SDPA builds one
  layer's (heads, T, T) scores at a time (`heads·Σ T²` values); on CUDA the fused kernels keep O(T) and the
  term is 0. A packed micro-batch also holds its (N, N) boolean block-diagonal mask.
- Logits: padded, the LM head's (N, V) output in the model dtype plus the float32 tensors the log-prob /
  entropy code makes (copy, log-softmax; softmax and product for the entropy; one gradient): `N·V·(b + 4·k)`.
  Packed, the LM head runs on response positions only and the float32 work is chunked (`_logits_row`).

Every number is bytes per GPU; each row prints its formula. The estimate is checked against the measured peak
memory of CPU runs in tests/unit/test_plan.py and bench/bench_plan.py, on a GPU by bench/gpu_memory_check.sh.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BUILTIN_SHAPES",
    "MemoryPlan",
    "ModelShape",
    "PlanError",
    "RolePlan",
    "activation_bytes",
    "gpu_budget",
    "make_plan",
    "measure_actor_update",
    "parse_bytes",
    "resolve_shape",
    "run_plan",
]

GiB = 1 << 30


class PlanError(ValueError):
    """The plan cannot be made (no model shape, bad size); the message names the input and the fix."""


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


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

    @property
    def kv_dim(self) -> int:
        """Width of k (and of v): kv heads × head dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v with biases (Qwen2), o, gate/up/down, two RMSNorms."""
        h, kv, i, q = (
            self.hidden_size,
            self.kv_dim,
            self.intermediate_size,
            self.num_attention_heads * self.head_dim,
        )
        return (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * i + 2 * h

    @property
    def embedding_params(self) -> int:
        """Input embedding (V × h); the LM head is the same tensor when tied."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: embedding, layers, final norm, LM head unless tied."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_hidden_layers * self.layer_params + self.hidden_size + head

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


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '141G', '512MiB' or a plain number of bytes -> bytes (GB and G are taken as GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise PlanError(f"--gpu-mem {text!r} is not a size; write e.g. 80GiB or 141GiB.")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


@dataclass
class Row:
    """One line of a role's table: a name, its bytes and the formula that gives them."""

    name: str
    bytes: int
    formula: str
    phase: str = ""
    """"" = held throughout; otherwise the pass it belongs to (the role's peak is the largest pass)."""


@dataclass
class RolePlan:
    """The estimate of one role on one GPU."""

    role: str
    rows: list[Row] = field(default_factory=list)
    knobs: list[str] = field(default_factory=list)
    """What to turn, biggest saving first, when the role does not fit."""
    budget: int | None = None
    """The GPU memory this role may use (vLLM: gpu_memory_utilization × GPU), when known."""

    @property
    def total(self) -> int:
        """Rows held throughout plus the largest pass (update or log-prob: they never run together)."""
        phases: dict[str, int] = {}
        for r in self.rows:
            if r.phase:
                phases[r.phase] = phases.get(r.phase, 0) + r.bytes
        return sum(r.bytes for r in self.rows if not r.phase) + max(phases.values(), default=0)

    def fits(self) -> bool | None:
        """True/False against `budget`, None when no budget is known."""
        return None if self.budget is None else self.total <= self.budget


@dataclass
class MemoryPlan:
    """Every role's estimate plus the assumptions used."""

    shape: ModelShape
    roles: list[RolePlan]
    gpu_mem: int | None
    assumptions: list[str]

    def failures(self) -> list[RolePlan]:
        """Roles that do not fit their budget."""
        return [r for r in self.roles if r.fits() is False]

    def render(self) -> str:
        """The table a person can check by hand."""
        s = self.shape
        out = [
            f"model: {s.source}",
            f"  h={s.hidden_size} layers={s.num_hidden_layers} heads={s.num_attention_heads} "
            f"kv_heads={s.num_key_value_heads} head_dim={s.head_dim} i={s.intermediate_size} "
            f"V={s.vocab_size} "
            f"tied={s.tie_word_embeddings} -> P={s.num_params:,} parameters",
            f"GPU memory: {_gib(self.gpu_mem) + ' per GPU' if self.gpu_mem else 'unknown (pass --gpu-mem)'}",
            *(f"assume: {a}" for a in self.assumptions),
            "",
        ]
        width = max((len(r.name) + len(r.phase) + 2 for role in self.roles for r in role.rows), default=10)
        for role in self.roles:
            out.append(f"[{role.role}]")
            for r in role.rows:
                name = f"{r.phase}: {r.name}" if r.phase else r.name
                out.append(f"  {name:<{width}} {_gib(r.bytes):>11}   = {r.formula}")
            verdict = {None: "", True: "  fits", False: "  DOES NOT FIT"}[role.fits()]
            budget = f" of {_gib(role.budget)}" if role.budget is not None else ""
            how = " (rows held throughout + the largest pass)" if any(r.phase for r in role.rows) else ""
            out.append(f"  {'total':<{width}} {_gib(role.total):>11}{budget}{verdict}{how}")
            if role.fits() is False:
                out.append(f"  turn: {'; or '.join(role.knobs) or 'a GPU with more memory'}")
            out.append("")
        return "\n".join(out)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"


def activation_values_per_token_layer(s: ModelShape) -> int:
    """Values autograd keeps per token and decoder layer without checkpointing: 8h + 4·kv + 4i."""
    return 8 * s.hidden_size + 4 * s.kv_dim + 4 * s.intermediate_size


def activation_bytes(
    s: ModelShape,
    tokens: int,
    act_bytes: int,
    checkpointing: bool,
    attn_sq_tokens: int = 0,
) -> tuple[int, str]:
    """Bytes of a micro-batch's activations at the update's peak (and the formula).

    Without checkpointing: every layer's saved tensors, `N·layers·(8h+4kv+4i)`. With checkpointing: each
    layer's input (`N·layers·h`) plus, in backward, one layer recomputed and its gradient working set
    (`2·N·(8h+4kv+4i)`). `attn_sq_tokens` = Σ T² of the attention blocks when the kernel builds one layer's
    (heads, T, T) scores at a time (CPU SDPA); 0 on CUDA's fused kernels.
    """
    per = activation_values_per_token_layer(s)
    L, h = s.num_hidden_layers, s.hidden_size
    scores = s.num_attention_heads * attn_sq_tokens
    if checkpointing:
        n = tokens * (L * h + 2 * per) + scores
        f = f"N·(layers·h + 2·(8h+4kv+4i))·b = {tokens}·({L}·{h} + 2·{per})·{act_bytes}"
    else:
        n = tokens * L * per + scores
        f = f"N·layers·(8h+4kv+4i)·b = {tokens}·{L}·{per}·{act_bytes}"
    if attn_sq_tokens:
        f += f" + heads·ΣT²·b (one layer's scores, ΣT²={attn_sq_tokens:,})"
    return n * act_bytes, f


def _micro_tokens(
    *, dynamic: bool, budget: int, micro_rows: int, width: int, packed: bool
) -> tuple[int, int, str]:
    """(tokens N of the largest micro-batch, Σ T² of its attention blocks, how N was chosen)."""
    if dynamic and packed:
        n = max(budget, width)
        return n, n * n, f"token budget {budget} (packed; a longer row goes alone, width {width})"
    if dynamic:
        rows = max(1, budget // width)
        return (
            rows * width,
            rows * width * width,
            f"{rows} row(s) × padded width {width} within budget {budget}",
        )
    if packed:
        return micro_rows * width, (micro_rows * width) ** 2, f"{micro_rows} rows × width {width}, packed"
    return micro_rows * width, micro_rows * width * width, f"{micro_rows} rows × padded width {width}"


def _training_rows(
    role: RolePlan,
    s: ModelShape,
    *,
    strategy: str,
    zero_stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    bf16: bool,
    dp: int,
) -> int:
    """Weights, gradients and optimizer rows of a trained model; returns the activation dtype's bytes."""
    P = s.num_params
    ds = strategy == "deepspeed"
    wb = 2 if ds and bf16 else 4
    opt_b = 12 if ds and bf16 else 8
    stage = zero_stage if ds else 0
    if ds:
        role.rows.append(
            Row(
                "whole model",
                P * wb,
                f"P·{wb} B: DeepSpeed moves the whole module to the GPU before ZeRO "
                "partitions it (we load it on the CPU for ZeRO-3)",
                "load",
            )
        )
    if stage == 3 and offload_param:
        work = 2 * s.layer_params + s.embedding_params
        role.rows.append(
            Row(
                "weights",
                work * wb,
                f"offload_param: 2 layers + embedding on GPU = (2·{s.layer_params:,} + "
                f"{s.embedding_params:,})·{wb} B",
            )
        )
    else:
        div = dp if stage == 3 else 1
        role.rows.append(Row("weights", P * wb // div, f"P·{wb} B" + (f" / dp {dp}" if div > 1 else "")))
    gdiv = dp if stage >= 2 else 1
    if offload_optimizer and stage >= 2:
        role.rows.append(Row("gradients", 0, "ZeRO-2/3 with offload_optimizer: fp32 partitions on the CPU"))
    else:
        role.rows.append(Row("gradients", P * wb // gdiv, f"P·{wb} B" + (f" / dp {dp}" if gdiv > 1 else "")))
    if offload_optimizer:
        role.rows.append(Row("optimizer", 0, "offload_optimizer: AdamW state on the CPU"))
    else:
        odiv = dp if stage >= 1 else 1
        what = "fp32 master + m + v" if opt_b == 12 else "AdamW m + v"
        role.rows.append(
            Row("optimizer", P * opt_b // odiv, f"P·{opt_b} B ({what})" + (f" / dp {dp}" if odiv > 1 else ""))
        )
    return wb


def _logits_row(
    s: ModelShape,
    tokens: int,
    model_bytes: int,
    *,
    entropy: bool,
    packed: bool,
    phase: str = "",
    grad: bool = True,
) -> Row:
    """The LM head's output and the float32 copies the log-prob (and entropy) code makes of it.

    Padded: (N, V) logits in the model dtype plus k float32 (N, V) tensors (fp32 copy, log-softmax, softmax
    and product for the entropy, one gradient). Packed (`use_remove_padding`): the LM head runs on response
    positions only (≤ N), its gradient is one more such tensor, and the float32 work is done in checkpointed
    chunks of `LOGIT_CHUNK_TOKENS` positions.
    """
    from dapo_core.compute.engines.train import LOGIT_CHUNK_TOKENS

    k = 2 + (2 if entropy else 0) + (1 if grad else 0)
    parts = (
        ["fp32 copy", "log-softmax"]
        + (["softmax", "product"] if entropy else [])
        + (["grad"] if grad else [])
    )
    V = s.vocab_size
    if packed:
        chunk = min(tokens, LOGIT_CHUNK_TOKENS)
        held = 2 if grad else 1
        return Row(
            "logits",
            tokens * V * model_bytes * held + chunk * V * 4 * k,
            f"N·V·b·{held} + chunk·V·4·{k} = {tokens}·{V}·{model_bytes}·{held} + {chunk}·{V}·{4 * k} "
            f"(response-position logits{', their grad' if grad else ''}; one chunk of {', '.join(parts)})",
            phase,
        )
    return Row(
        "logits",
        tokens * V * (model_bytes + 4 * k),
        f"N·V·(b + 4·{k}) = {tokens}·{V}·({model_bytes} + {4 * k}) ({', '.join(parts)})",
        phase,
    )


def _no_grad_row(s: ModelShape, tokens: int, b: int, attn_sq: int, how: str, phase: str) -> Row:
    """A forward without gradients keeps one layer's tensors alive at a time: N·(4h + 2i)·b (+ scores)."""
    n = tokens * (4 * s.hidden_size + 2 * s.intermediate_size) + s.num_attention_heads * attn_sq
    return Row(
        "activations (no grad)", n * b, f"N·(4h + 2i)·b + heads·ΣT²·b, one layer live; N: {how}", phase
    )


def make_plan(
    cfg: Any,
    *,
    gpu_mem: int | None = None,
    model_config: str | None = None,
    dp: int = 1,
    device: str | None = None,
) -> MemoryPlan:
    """The per-GPU estimate of every role of the resolved config `cfg` (a DapoConfig)."""
    from dapo_core.config.loading import need_reference_policy, use_critic

    if dp < 1:
        raise PlanError(f"--dp {dp} must be >= 1.")
    s = resolve_shape(cfg, model_config)
    arr = cfg.actor_rollout_ref
    actor, ro, ref = arr.actor, arr.rollout, arr.ref
    dev = device or ("cuda" if str(cfg.trainer.device) in ("cuda", "auto") else "cpu")
    scores_on = dev == "cpu"
    width = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    n = int(ro.n)
    mini_rows = int(actor.ppo_mini_batch_size) * n
    ckpt = bool(arr.model.enable_gradient_checkpointing)
    packed = bool(arr.model.use_remove_padding)
    assumptions = [
        "one GPU per model-holding role, no two roles on one GPU (flows/run_setup.py asks num_gpus=1 each)",
        f"data-parallel world dp={dp} for ZeRO partitions"
        + (
            " (what dapo train runs: one process per role)" if dp == 1 else " (what-if; dapo train runs dp=1)"
        ),
        f"sequence width T = max_prompt_length + max_response_length = {width}",
        "attention scores "
        + ("materialised (CPU SDPA math path)" if scores_on else "not kept (CUDA fused kernels)"),
    ]
    roles: list[RolePlan] = []

    # -- actor
    ds = actor.deepspeed
    a = RolePlan("actor", budget=gpu_mem)
    wb = _training_rows(
        a,
        s,
        strategy=str(actor.strategy),
        zero_stage=int(ds.zero_stage),
        offload_optimizer=bool(ds.offload_optimizer),
        offload_param=bool(ds.offload_param),
        bf16=bool(ds.bf16),
        dp=dp,
    )
    micro = int(actor.ppo_micro_batch_size_per_gpu or mini_rows)
    tokens, sq, how = _micro_tokens(
        dynamic=bool(actor.use_dynamic_bsz),
        budget=int(actor.ppo_max_token_len_per_gpu),
        micro_rows=micro,
        width=width,
        packed=packed,
    )
    act, f = activation_bytes(s, tokens, wb, ckpt, sq if scores_on else 0)
    a.rows.append(Row("activations" + (" (ckpt)" if ckpt else ""), act, f"{f}; N: {how}", "update"))
    if packed:
        a.rows.append(
            Row("packed mask", tokens * tokens, f"N²·1 B (block-diagonal bool mask) = {tokens}²", "update")
        )
    a.rows.append(_logits_row(s, tokens, wb, entropy=True, packed=packed, phase="update"))
    lp_tokens, lp_sq, lp_how = _micro_tokens(
        dynamic=bool(ro.log_prob_use_dynamic_bsz),
        budget=int(ro.log_prob_max_token_len_per_gpu),
        micro_rows=int(ro.log_prob_micro_batch_size_per_gpu or int(cfg.data.train_batch_size) * n),
        width=width,
        packed=packed,
    )
    a.rows.append(_no_grad_row(s, lp_tokens, wb, lp_sq if scores_on else 0, lp_how, "log-prob"))
    if packed:
        a.rows.append(Row("packed mask", lp_tokens**2, f"N²·1 B = {lp_tokens}²", "log-prob"))
    a.rows.append(_logits_row(s, lp_tokens, wb, entropy=True, packed=packed, phase="log-prob", grad=False))
    a.knobs = _training_knobs(cfg=cfg, ckpt=ckpt, packed=packed)
    roles.append(a)

    # -- reference
    if need_reference_policy(cfg):
        r = RolePlan("ref", budget=gpu_mem)
        r.rows.append(Row("weights", s.num_params * 4, "P·4 B (torch engine, float32, forward only)"))
        rt, rsq, rhow = _micro_tokens(
            dynamic=bool(ref.log_prob_use_dynamic_bsz),
            budget=int(ref.log_prob_max_token_len_per_gpu),
            micro_rows=int(ref.log_prob_micro_batch_size_per_gpu or int(cfg.data.train_batch_size) * n),
            width=width,
            packed=packed,
        )
        r.rows.append(_no_grad_row(s, rt, 4, rsq if scores_on else 0, rhow, ""))
        r.rows.append(_logits_row(s, rt, 4, entropy=False, packed=packed, grad=False))
        r.knobs = [
            "lower actor_rollout_ref.ref.log_prob_max_token_len_per_gpu (ref.log_prob_use_dynamic_bsz=true)",
            "set actor_rollout_ref.model.use_remove_padding=true",
        ]
        roles.append(r)

    # -- critic
    if use_critic(cfg):
        c = RolePlan("critic", budget=gpu_mem)
        crit = cfg.critic
        cckpt = (
            ckpt
            if crit.model.enable_gradient_checkpointing is None
            else bool(crit.model.enable_gradient_checkpointing)
        )
        cpacked = bool(crit.model.use_remove_padding)
        cdyn = bool(actor.use_dynamic_bsz if crit.use_dynamic_bsz is None else crit.use_dynamic_bsz)
        cbudget = int(crit.ppo_max_token_len_per_gpu)
        cp = s.num_params - (0 if s.tie_word_embeddings else s.embedding_params)  # no LM head; + value head
        c.rows.append(
            Row("weights+grads+optim", cp * 16, f"P_backbone·(4+4+8) B = {cp:,}·16 (torch AdamW fp32)")
        )
        cmicro = int(crit.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu or mini_rows)
        ct, csq, chow = _micro_tokens(
            dynamic=cdyn, budget=cbudget, micro_rows=cmicro, width=width, packed=cpacked
        )
        cact, cf = activation_bytes(s, ct, 4, cckpt, csq if scores_on else 0)
        c.rows.append(Row("activations" + (" (ckpt)" if cckpt else ""), cact, f"{cf}; N: {chow}", "update"))
        if cpacked:
            c.rows.append(Row("packed mask", ct * ct, f"N²·1 B (block-diagonal bool mask) = {ct}²", "update"))
        c.rows.append(Row("values", ct * s.hidden_size * 4, "N·h·4 B (value head input)", "update"))
        vt, vsq, vhow = _micro_tokens(
            dynamic=cdyn,
            budget=int(crit.forward_max_token_len_per_gpu or cbudget),
            micro_rows=int(cfg.data.train_batch_size) * n,
            width=width,
            packed=cpacked,
        )
        c.rows.append(_no_grad_row(s, vt, 4, vsq if scores_on else 0, vhow, "values"))
        if cpacked:
            c.rows.append(Row("packed mask", vt * vt, f"N²·1 B = {vt}²", "values"))
        c.knobs = [
            "" if cckpt else "set critic.model.enable_gradient_checkpointing=true",
            "" if cpacked else "set critic.model.use_remove_padding=true",
            f"lower critic.ppo_max_token_len_per_gpu (now {cbudget}) and critic.forward_max_token_len_per_gpu"
            if cdyn
            else "set critic.use_dynamic_bsz=true with a ppo_max_token_len_per_gpu, or lower "
            "critic.ppo_micro_batch_size_per_gpu",
        ]
        c.knobs = [k for k in c.knobs if k]
        roles.append(c)

    # -- rollout
    roles.append(_rollout_plan(cfg, s, gpu_mem, width, assumptions))
    return MemoryPlan(shape=s, roles=roles, gpu_mem=gpu_mem, assumptions=assumptions)


def _training_knobs(*, cfg: Any, ckpt: bool, packed: bool) -> list[str]:
    actor = cfg.actor_rollout_ref.actor
    ds = actor.deepspeed
    knobs = []
    if not ckpt:
        knobs.append("set actor_rollout_ref.model.enable_gradient_checkpointing=true")
    if not packed:
        knobs.append("set actor_rollout_ref.model.use_remove_padding=true")
    if actor.use_dynamic_bsz:
        knobs.append(
            f"lower actor_rollout_ref.actor.ppo_max_token_len_per_gpu (now {actor.ppo_max_token_len_per_gpu})"
        )
    else:
        knobs.append(
            "set actor_rollout_ref.actor.use_dynamic_bsz=true with a ppo_max_token_len_per_gpu, or lower "
            "ppo_micro_batch_size_per_gpu"
        )
    if actor.strategy != "deepspeed":
        knobs.append("set actor_rollout_ref.actor.strategy=deepspeed with deepspeed.bf16=true")
    else:
        if not ds.offload_optimizer:
            knobs.append("set actor_rollout_ref.actor.deepspeed.offload_optimizer=true")
        if int(ds.zero_stage) < 3:
            knobs.append("raise actor_rollout_ref.actor.deepspeed.zero_stage to 3")
        if not ds.offload_param:
            knobs.append("set actor_rollout_ref.actor.deepspeed.offload_param=true (ZeRO-3)")
        if not ds.bf16:
            knobs.append("set actor_rollout_ref.actor.deepspeed.bf16=true")
    return knobs


def _rollout_plan(
    cfg: Any, s: ModelShape, gpu_mem: int | None, width: int, assumptions: list[str]
) -> RolePlan:
    ro = cfg.actor_rollout_ref.rollout
    kv_per_token = 2 * s.num_hidden_layers * s.kv_dim * s.dtype_bytes
    if ro.name == "vllm":
        tp = int(ro.tensor_model_parallel_size)
        util = float(ro.gpu_memory_utilization)
        r = RolePlan("rollout", budget=None if gpu_mem is None else int(util * gpu_mem))
        w = s.num_params * s.dtype_bytes // tp
        r.rows.append(Row("weights", w, f"P·{s.dtype_bytes} B / tp {tp}"))
        one_seq = width * kv_per_token // tp
        if gpu_mem is None:
            r.rows.append(
                Row(
                    "kv cache (1 seq)",
                    one_seq,
                    f"T·2·layers·kv·b / tp = {width}·2·{s.num_hidden_layers}·{s.kv_dim}·"
                    f"{s.dtype_bytes} / {tp} (vLLM takes all it is given: util × GPU)",
                )
            )
        else:
            kv = max(0, int(util * gpu_mem) - w)
            r.rows.append(
                Row(
                    "kv cache",
                    kv,
                    f"util·GPU − weights = {util}·{_gib(gpu_mem)} − weights (vLLM fills the rest)",
                )
            )
            seqs = kv // max(1, one_seq)
            assumptions.append(
                f"rollout KV cache holds {seqs} full-length sequences per tp group "
                f"({kv_per_token // tp:,} B per token per GPU); vLLM needs at least 1"
            )
            if seqs < 1:
                r.rows.append(Row("kv shortfall", one_seq - kv, "one full sequence does not fit"))
        r.knobs = [
            "raise actor_rollout_ref.rollout.gpu_memory_utilization",
            "raise actor_rollout_ref.rollout.tensor_model_parallel_size",
        ]
        return r
    r = RolePlan("rollout", budget=gpu_mem)
    rows = int(cfg.data.gen_batch_size or cfg.data.train_batch_size) * int(ro.n)
    r.rows.append(Row("weights", s.num_params * 4, "P·4 B (HF generate, float32)"))
    r.rows.append(
        Row(
            "kv cache",
            rows * width * kv_per_token * 4 // s.dtype_bytes,
            f"rows·T·2·layers·kv·4 B = {rows}·{width}·2·{s.num_hidden_layers}·{s.kv_dim}·4",
        )
    )
    r.knobs = ["set actor_rollout_ref.rollout.name=vllm", "lower data.gen_batch_size"]
    return r


def gpu_budget(gpu_mem: str | None) -> tuple[int | None, str]:
    """The per-GPU memory to check against: `--gpu-mem`, else the first visible CUDA device, else None."""
    if gpu_mem:
        return parse_bytes(gpu_mem), f"--gpu-mem {gpu_mem}"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"CUDA device 0 ({props.name})"
    return None, "no GPU budget known"


def run_plan(
    cfg: Any,
    command: str,
    *,
    gpu_mem: str | None = None,
    model_config: str | None = None,
    dp: int = 1,
    out: Any = None,
) -> int:
    """Print the plan of `cfg`; return 0 when it fits (or no budget is known), 2 when a role does not fit.

    `command` is "plan" or "train": for `dapo train` a plan that cannot be made (no model shape known) is a
    note, not an error, and the run goes on.
    """
    import sys

    out = out or sys.stdout
    try:
        budget, where = gpu_budget(gpu_mem)
        if gpu_mem is None and str(cfg.trainer.device) == "cpu":
            budget, where = None, "trainer.device=cpu: no GPU budget"
        plan = make_plan(cfg, gpu_mem=budget, model_config=model_config, dp=dp)
    except PlanError as e:
        if command == "train":
            print(f"dapo train: note: no memory plan ({e})", file=sys.stderr)
            return 0
        print(f"dapo {command}: {e}", file=sys.stderr)
        return 2
    print(f"dapo {command}: per-GPU memory plan ({where})", file=out)
    print(plan.render(), file=out, flush=True)
    failures = plan.failures()
    if not failures:
        return 0
    lines = [
        f"dapo {command}: role {r.role} needs {_gib(r.total)} but has {_gib(r.budget)} per GPU; "
        f"turn: {'; or '.join(r.knobs) or 'a GPU with more memory'}."
        for r in failures
    ]
    if command == "train":
        lines.append("dapo train: refusing to start a run that cannot fit (see the plan above).")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 2


def _rss_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure_actor_update(
    cfg: Any, model_path: str, *, device: str = "cpu", seed: int = 0, steps: int = 1
) -> dict[str, int]:
    """Measure the peak memory of actor updates above the loaded weights, next to the plan's estimate.

    Builds the `ActorWorker` as flows/run_setup.py does and runs `update_actor` `steps` times on one
    mini-batch of rows at full width (max_prompt_length + max_response_length, the plan's worst case).
    On CPU the peak is the process's resident high-water mark (VmHWM, reset through
    /proc/self/clear_refs after the weights are loaded) minus the resident size then; on CUDA it is
    `torch.cuda.max_memory_allocated` minus the allocation after loading. Returns `measured` and
    `estimated` bytes (the plan's actor rows except the weights, with the update pass) and `weights`
    (the plan's weight row).
    """

    import dataclasses

    import pyarrow as pa
    import torch

    from dapo_core.compute.workers.actor import ActorWorker

    arr = cfg.actor_rollout_ref
    rows = int(arr.actor.ppo_mini_batch_size) * int(arr.rollout.n)
    P, R = int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)
    worker = ActorWorker(
        model_path,
        dataclasses.asdict(arr.actor),
        pad_token_id=0,
        temperature=1.0,
        rollout_n=int(arr.rollout.n),
        total_steps=10,
        device=device,
        seed=seed,
        gradient_checkpointing=bool(arr.model.enable_gradient_checkpointing),
        use_remove_padding=bool(arr.model.use_remove_padding),
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (rows, P + R), generator=g)
    table = pa.table(
        {
            "prompt_ids": pa.array(ids[:, :P].tolist(), type=pa.list_(pa.int32())),
            "response_ids": pa.array(ids[:, P:].tolist(), type=pa.list_(pa.int32())),
            "old_log_probs": pa.array((-4.6 * torch.ones(rows, R)).tolist(), type=pa.list_(pa.float32())),
            "advantages": pa.array(torch.randn(rows, R, generator=g).tolist(), type=pa.list_(pa.float32())),
        }
    )
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for step in range(steps):
            worker.update_actor(table, step)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        for step in range(steps):
            worker.update_actor(table, step)
        measured = _rss_bytes("VmHWM") - base
    plan = make_plan(cfg, device=device)
    actor = next(r for r in plan.roles if r.role == "actor")
    weights = sum(r.bytes for r in actor.rows if r.name == "weights")
    estimated = sum(r.bytes for r in actor.rows if r.phase in ("", "update") and r.name != "weights")
    return {"measured": int(measured), "estimated": int(estimated), "weights": int(weights)}
