"""Variable-length attention for packed forwards: no (N, N) mask.

A packed forward (`microbatch.pack_rows`) runs a micro-batch's valid tokens as one (1, N) sequence; row b
holds positions [cu_seqlens[b], cu_seqlens[b+1]). Inside `packed_attention(model, cu_seqlens, max_seqlen)`
the model gets those boundaries as transformers' flash-attention kwargs (`cu_seq_lens_q/k`,
`max_length_q/k`) and no mask is built; each attention layer then runs `varlen_attention`:

- on CUDA in float16 / bfloat16 (the weights' dtype or autocast's), head dim a multiple of 8 up to 256,
  compute capability 8.0+: torch's flash kernel `torch.nn.attention.varlen.varlen_attn` (torch 2.10 on;
  causal window (-1, 0); GQA without repeating KV heads from torch 2.12; backward included);
- otherwise (CPU, float32 / float64): one causal SDPA per row, concatenated: O(sum of len²) memory.

Either way a token attends to the earlier tokens of its own row only, as in the padded forward. An SDPA
model opts in once (`packed_attention` calls `model.set_attn_implementation(VARLEN_ATTENTION)`) and keeps
it: without the packing kwargs `varlen_attention` is transformers' SDPA, and outside `packed_attention` the
mask function is SDPA's, so padded, 4-D-mask and KV-cache forwards run as before. The implementation is
kept rather than switched for the packed call alone because gradient checkpointing re-runs each layer in
backward, after the call returned, reading the model's implementation again; the kwargs travel with the
re-run. A flash-attention model takes the same kwargs natively; other implementations (eager) get none and
build transformers' block-diagonal mask from the position ids.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = [
    "VARLEN_ATTENTION",
    "kernel_supports",
    "packed_attention",
    "register_varlen_attention",
    "segment_attention",
    "varlen_attention",
    "varlen_kernel",
    "varlen_mask",
]

VARLEN_ATTENTION = "dapo_varlen"
"""Name of `varlen_attention` (and of its mask function) in transformers' attention interfaces."""

_PACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("dapo_packed_forward", default=False)
"""True inside `packed_attention`: the mask function builds no mask."""

_varlen_attn: Callable[..., Any] | None
try:  # torch >= 2.9
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch: per-row SDPA everywhere
    _varlen_attn = None


def varlen_kernel() -> Callable[..., Any] | None:
    """torch's `varlen_attn` when the installed torch has one that takes `scale` and `window_size` (torch 2.10
    on; 2.9's took neither), else None."""
    return _varlen_attn if {"scale", "window_size"} <= _kernel_params() else None


@functools.cache
def _kernel_params() -> frozenset[str]:
    """The keyword parameters of the installed `varlen_attn` (`enable_gqa` from torch 2.12 on)."""
    return frozenset() if _varlen_attn is None else frozenset(inspect.signature(_varlen_attn).parameters)


@functools.lru_cache(maxsize=8)
def _flash_capable(device_index: int) -> bool:
    """Whether the CUDA device runs flash attention (compute capability 8.0 or newer)."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def kernel_supports(query: torch.Tensor, key: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `varlen_attn` serves this call: a CUDA tensor on a flash-capable device, `dtype` float16 /
    bfloat16, equal head dims that are a multiple of 8 up to 256."""
    dim = int(query.shape[-1])
    return (
        varlen_kernel() is not None
        and query.is_cuda
        and dtype in (torch.float16, torch.bfloat16)
        and dim == int(key.shape[-1])
        and dim % 8 == 0
        and dim <= 256
        and _flash_capable(query.device.index if query.device.index is not None else 0)
    )


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scale: float | None
) -> torch.Tensor:
    """Causal SDPA over each segment [bounds[i], bounds[i+1]) of the packed query (1, H, N, d) and key / value
    (1, KV, N, d), H a multiple of KV; returns (1, N, H, d). Empty segments are skipped; differentiable."""
    gqa = query.shape[1] != key.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scale, enable_gqa=gqa
        )
        for s, e in itertools.pairwise(bounds)
        if e > s
    ]
    if not parts:
        return query.new_empty((1, 0, query.shape[1], value.shape[-1]))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _kernel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`varlen_attn` on (1, H, N, d) / (1, KV, N, d) inputs cast to `dtype`; returns (1, N, H, d). A torch
    without the kernel's GQA gets each KV head repeated for its query heads."""
    kernel = varlen_kernel()
    assert kernel is not None
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # (N, heads, d)
    gqa: dict[str, bool] = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _kernel_params():
            gqa["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    out = kernel(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0), **gqa)  # causal
    assert isinstance(out, torch.Tensor)
    return out.unsqueeze(0)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would compute in: autocast's on the query's device when enabled, else the query's."""
    kind = query.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return query.dtype


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, Q, d), key / value (B, KV, L, d); returns
    (B, Q, H, d) and no weights.

    With `cu_seq_lens_q` (int32 (S+1,), the packed rows' boundaries) and `max_length_q` the call is a packed
    forward: B = 1, Q = L = N, no mask; each segment attends causally within itself (kernel on CUDA half
    precision, per-segment SDPA otherwise; module docstring). Without them: transformers' SDPA unchanged.
    The packed path is causal and refuses dropout (policy training runs the attention without it), sliding
    windows, soft-caps, attention sinks and position biases."""
    cu = kwargs.pop("cu_seq_lens_q", None)
    cu_k = kwargs.pop("cu_seq_lens_k", None)
    max_len = kwargs.pop("max_length_q", None)
    kwargs.pop("max_length_k", None)
    if cu is None:
        if _PACKED.get():
            raise RuntimeError(
                "a packed forward reached the attention without cu_seq_lens_q (no mask was built)"
            )
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    unsupported = [
        k for k in ("sliding_window", "softcap", "s_aux", "position_bias") if kwargs.get(k) is not None
    ]
    if is_causal is False or getattr(module, "is_causal", True) is False:
        unsupported.append("bidirectional attention")
    if unsupported or dropout:
        raise ValueError(
            f"packed (remove_padding) attention supports no {unsupported or ['dropout']}: set "
            "use_remove_padding=false for this model, or its attention_dropout to 0."
        )
    if attention_mask is not None:
        raise ValueError("packed attention takes no mask; run the packed forward inside packed_attention()")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError("packed attention is self-attention: cu_seq_lens_k must equal cu_seq_lens_q")
    if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"packed attention takes one (1, heads, N, d) sequence; got query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}"
        )
    dtype = _compute_dtype(query)
    if kernel_supports(query, key, dtype):
        longest = int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
        return _kernel_attention(query, key, value, cu, longest, scaling, dtype), None
    bounds = [int(b) for b in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(
            f"cu_seq_lens_q runs from {bounds[0]} to {bounds[-1]}, not over the {query.shape[2]} tokens"
        )
    return segment_attention(query, key, value, bounds, scaling), None


def varlen_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with `VARLEN_ATTENTION`: None inside `packed_attention` (the kernel reads
    the rows' boundaries instead), else transformers' `sdpa_mask`."""
    if _PACKED.get():
        return None
    return sdpa_mask(*args, **kwargs)


def register_varlen_attention() -> None:
    """Register `varlen_attention` and `varlen_mask` under `VARLEN_ATTENTION` (idempotent)."""
    if ALL_ATTENTION_FUNCTIONS.get(VARLEN_ATTENTION) is not varlen_attention:
        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    if ALL_MASK_ATTENTION_FUNCTIONS.get(VARLEN_ATTENTION) is not varlen_mask:
        ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_ATTENTION, varlen_mask)


@contextlib.contextmanager
def packed_attention(
    model: Any, cu_seqlens: torch.Tensor, max_seqlen: int, device: torch.device | str
) -> Iterator[dict[str, Any]]:
    """Run a packed forward of `model` (an HF `PreTrainedModel`) inside this block with the kwargs it yields.

    An SDPA model is switched to `VARLEN_ATTENTION` (once; it stays) and gets the rows' boundaries
    `cu_seqlens` ((B+1,), rows without tokens allowed; see `PackedRows.cu_seqlens`) and `max_seqlen` as
    `cu_seq_lens_q/k` and `max_length_q/k` on `device`, with no mask built; a flash-attention model gets the
    same kwargs; any other implementation none (transformers masks by the position ids)."""
    config = model.config
    if config._attn_implementation == "sdpa":
        register_varlen_attention()
        model.set_attn_implementation(VARLEN_ATTENTION)
    impl = str(config._attn_implementation)
    if impl != VARLEN_ATTENTION and not impl.startswith("flash_attention"):
        yield {}
        return
    cu = torch.unique_consecutive(cu_seqlens.to("cpu", torch.int32)).to(device)  # empty rows dropped
    kwargs = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }
    token = _PACKED.set(impl == VARLEN_ATTENTION)
    try:
        yield kwargs
    finally:
        _PACKED.reset(token)


register_varlen_attention()
