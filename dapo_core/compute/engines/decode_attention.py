"""Attention for the HF rollout engine's one-token decode steps, as two batched matmuls around a softmax.

For a single query position PyTorch's CPU SDPA runs its flash kernel on a 1-row query block (2 rows with
transformers' grouped-query packing) and spends most of its time outside the arithmetic. On the CPU default's
generation batch (a trained tiny policy, 44 prompts x 8 samples, ~20 new tokens) SDPA was 122.7 ms of a
406 ms generation under the profiler and this was 82.6 ms (bench/README.md, "Decode attention").

The query heads are grouped under their KV head, `(B, kv_heads, group, d) @ (B, kv_heads, d, L)`, so no KV
head is repeated, and each row's numbers come from its own slice of each batched matmul: a row still does
not depend on its neighbours. The result agrees with SDPA to float rounding (~1e-6 on the probabilities), not
bitwise. Prefill, anything with gradients, a position bias, a soft-cap or dropout go to transformers' SDPA
unchanged. Registered under `DECODE_ATTENTION` with transformers' attention and mask interfaces (the mask is
SDPA's), so a model opts in with `model.set_attn_implementation(DECODE_ATTENTION)`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

__all__ = ["DECODE_ATTENTION", "decode_attention"]

DECODE_ATTENTION = "dapo_decode_sdpa"
"""Name of the implementation in transformers' `AttentionInterface`: `decode_attention`."""


def decode_attention(
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
    """transformers' attention-function signature: query (B, H, Q, d), key / value (B, KV, L, d), a boolean
    (True = attend) or additive mask broadcastable to (B, 1, Q, L); returns (B, Q, H, d) and no weights."""
    special = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    if query.shape[2] != 1 or dropout or special or (torch.is_grad_enabled() and query.requires_grad):
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
    b, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)  # (B, KV, group, L)
    if attention_mask is not None:
        mask = attention_mask.reshape(attention_mask.shape[0], 1, 1, length)
        is_bool = mask.dtype == torch.bool  # True = attend; else additive
        scores = scores.masked_fill_(~mask, float("-inf")) if is_bool else scores.add_(mask)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # (B, KV, group, d)
    return out.reshape(b, 1, heads, dim), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)
