"""Attention for the HF rollout engine's one-token decode steps, as two batched matmuls around a softmax.

For a single query position PyTorch's CPU SDPA runs its flash kernel on a 1-row query block and spends most
of its time outside the arithmetic (bench/README.md, "Decode attention"). Here the query heads are grouped
under their KV head, `(B, kv_heads, group, d) @ (B, kv_heads, d, L)`, so no KV head is repeated and each
row's numbers come from its own slice of each matmul; the result agrees with SDPA to float rounding, not
bitwise. Prefill, gradients, a position bias, a soft-cap or dropout go to transformers' SDPA unchanged. A
model opts in with `model.set_attn_implementation(DECODE_ATTENTION)` (registered with transformers'
attention and mask interfaces; the mask is SDPA's).

Shared prompts (`SharedPrefixCache`, passed to the forward as `shared_prefix=`): the cache keeps each
distinct prompt's keys and values once and only the generated positions per row; a decode step reads a
prompt's keys once for all of its rows and each row's own generated keys, the two score blocks meeting in
one softmax. A row alone and in a batch agree to float rounding (tested).
docs/ARCHITECTURE.md (Engines) says why.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

__all__ = [
    "DECODE_ATTENTION",
    "SharedPrefixCache",
    "SharedPrefixLayer",
    "append_reserved",
    "decode_attention",
    "shared_prefix_cache",
]

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
    shared = kwargs.pop("shared_prefix", None)
    if query.shape[2] != 1 or dropout or special or (torch.is_grad_enabled() and query.requires_grad):
        if shared is not None:
            raise ValueError(
                "shared_prefix= serves one-token decode steps without gradients, dropout, position bias or "
                "soft-cap; run this forward without it."
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
    b, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    if shared is not None:
        return _shared_prefix_step(shared, vars(module)["layer_idx"], query, key, value, scale), None
    grouped = query.reshape(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)  # (B, KV, group, L)
    if attention_mask is not None:
        mask = attention_mask.reshape(attention_mask.shape[0], 1, 1, length)
        is_bool = mask.dtype == torch.bool  # True = attend; else additive
        scores = scores.masked_fill_(~mask, float("-inf")) if is_bool else scores.add_(mask)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # (B, KV, group, d)
    return out.reshape(b, 1, heads, dim), None


def _shared_prefix_step(
    cache: SharedPrefixCache,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step over a shared-prompt cache: query (B, H, 1, d); key / value the rows' generated
    positions (B, KV, t, d); the prompts' keys and values from `cache`'s layer `layer_idx`."""
    layer = cache.shared_layers[layer_idx]
    prefix_keys, prefix_values, bias = layer.prefix_keys, layer.prefix_values, cache.prefix_bias
    assert prefix_keys is not None and prefix_values is not None and bias is not None
    b, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    # Row r sits at slot[r] of the U·m stacked rows (m rows per prompt); no slots: the rows already come
    # prompt by prompt, m each (a generation before its first compaction), so stacking is a reshape.
    slot, m = cache.slots()
    u, p = prefix_keys.shape[0], prefix_keys.shape[2]
    q = query.reshape(b, kv_heads, group, dim)

    def stacked(x: torch.Tensor) -> torch.Tensor:  # (B, KV, group, w) -> (U, KV, m·group, w)
        grid = x
        if slot is not None:
            grid = x.new_zeros((u * m, kv_heads, group, x.shape[-1]))
            grid[slot] = x
        return grid.reshape(u, m, kv_heads, group, -1).transpose(1, 2).reshape(u, kv_heads, m * group, -1)

    def unstacked(x: torch.Tensor) -> torch.Tensor:  # (U, KV, m·group, w) -> (B, KV, group, w)
        w = x.shape[-1]
        rows = x.reshape(u, kv_heads, m, group, w).transpose(1, 2).reshape(u * m, kv_heads, group, w)
        return rows if slot is None else rows[slot]

    prompt_scores = torch.matmul(stacked(q), prefix_keys.transpose(-1, -2)).mul_(scale)
    prompt_scores = unstacked(prompt_scores.add_(bias[:, None, None, :]))
    own_scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)  # (B, KV, group, t)
    probs = torch.softmax(torch.cat([prompt_scores, own_scores], dim=-1), dim=-1)
    out = unstacked(torch.matmul(stacked(probs[..., :p]), prefix_values))
    out = out.add_(torch.matmul(probs[..., p:], value))
    return out.reshape(b, 1, heads, dim)


def append_reserved(
    layer: Any, key_states: torch.Tensor, value_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write `key_states` / `value_states` (B, KV, q, d) at `layer.length` into the layer's buffers `_keys` /
    `_values`, reserved for `layer.capacity` positions on the first write; `keys` / `values` become views of
    the first `length` positions (no copy of the cache per token, unlike HF's growing `DynamicLayer`)."""
    if layer.length == 0:
        b, h, _, d = key_states.shape
        layer._keys = key_states.new_empty((b, h, layer.capacity, d))
        layer._values = value_states.new_empty((b, h, layer.capacity, value_states.shape[-1]))
    end = layer.length + key_states.shape[-2]
    if end > layer.capacity:
        raise RuntimeError(f"KV cache reserved for {layer.capacity} positions, asked for {end}")
    layer._keys[:, :, layer.length : end] = key_states
    layer._values[:, :, layer.length : end] = value_states
    layer.length = end
    layer.keys, layer.values = layer._keys[:, :, :end], layer._values[:, :, :end]
    return layer.keys, layer.values


class SharedPrefixLayer(DynamicLayer):
    """One layer of a `SharedPrefixCache`: the distinct prompts' keys and values as the prefill computed
    them (`prefix_keys` / `prefix_values`, (U, KV, P, d)) and each row's generated positions in a buffer
    reserved for `capacity` tokens (`keys` / `values` are views of its first `length` positions)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = int(capacity)
        self.length = 0
        self._keys = self._values = torch.empty(0)  # the reserved buffers, made on the first write
        self.prefix_keys: torch.Tensor | None = None
        self.prefix_values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefix_keys is None:  # the prefill: one row per distinct prompt
            self.lazy_initialization(key_states, value_states)
            self.prefix_keys, self.prefix_values = key_states, value_states
            return key_states, value_states
        return append_reserved(self, key_states, value_states)

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2] + self.length

    def get_mask_sizes(self, query_length: Any, *args: Any, **kwargs: Any) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.get_seq_length() + q, 0

    def select(self, rows: torch.Tensor, prompts: torch.Tensor | None) -> None:
        """Keep the generated positions of `rows` and, when given, only the prompts `prompts`."""
        if self.length:
            self._keys, self._values = self._keys[rows], self._values[rows]
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]
        if prompts is not None and self.prefix_keys is not None and self.prefix_values is not None:
            self.prefix_keys, self.prefix_values = self.prefix_keys[prompts], self.prefix_values[prompts]


class SharedPrefixCache(DynamicCache):
    """A KV cache for rows that share prompts (see the module docstring). Use: a prefill forward over the
    distinct prompts, then `share(row_prompt, prompt_mask)`, then one-token forwards with
    `shared_prefix=<this cache>` and no attention mask. `batch_select_indices(rows)` keeps those rows (and
    drops prompts no row uses any more)."""

    def __init__(self, config: Any, capacity: int) -> None:
        super().__init__(config=config)
        # whether transformers laid this model's cache out as one plain DynamicLayer per layer
        self.plain_layout = bool(self.layers) and all(type(layer) is DynamicLayer for layer in self.layers)
        self.shared_layers = [SharedPrefixLayer(capacity) for _ in self.layers]
        self.layers = list(self.shared_layers)
        self.row_prompt: torch.Tensor | None = None  # (B,) the prompt of each row
        self.prefix_bias: torch.Tensor | None = None  # (U, P) 0 where a prompt has a token, -inf at padding
        self._slots: tuple[torch.Tensor | None, int] | None = None

    def share(self, row_prompt: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """After the prefill: row r continues prompt `row_prompt[r]`; `prompt_mask` (U, P) marks the prompts'
        real (non-padding) positions."""
        first = self.shared_layers[0].prefix_keys
        dtype = first.dtype if first is not None else torch.float32
        bias = torch.zeros(prompt_mask.shape, dtype=dtype, device=prompt_mask.device)
        self.prefix_bias = bias.masked_fill_(prompt_mask == 0, float("-inf"))
        self.row_prompt = row_prompt
        self._slots = None

    def slots(self) -> tuple[torch.Tensor | None, int]:
        """Where each row sits when the rows are stacked by prompt, m rows per prompt: (slot (B,), m); slot is
        None when row r already sits at r (rows prompt by prompt, every prompt with m rows)."""
        if self._slots is None:
            assert self.row_prompt is not None and self.prefix_bias is not None
            rp = self.row_prompt
            counts = torch.bincount(rp, minlength=self.prefix_bias.shape[0])
            m = int(counts.max())
            order = torch.argsort(rp, stable=True)
            first = torch.cumsum(counts, 0) - counts  # first sorted position of each prompt
            sorted_rp = rp[order]
            slot = torch.empty_like(rp)
            slot[order] = sorted_rp * m + torch.arange(rp.numel(), device=rp.device) - first[sorted_rp]
            identity = slot.numel() == counts.numel() * m and bool(
                (slot == torch.arange(slot.numel(), device=slot.device)).all()
            )
            self._slots = (None if identity else slot, m)
        return self._slots

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        assert self.row_prompt is not None and self.prefix_bias is not None
        kept = self.row_prompt[indices]
        used, renumbered = torch.unique(kept, return_inverse=True)
        prompts = used if used.numel() < self.prefix_bias.shape[0] else None
        for layer in self.shared_layers:
            layer.select(indices, prompts)
        if prompts is not None:
            self.prefix_bias = self.prefix_bias[prompts]
            kept = renumbered
        self.row_prompt = kept
        self._slots = None


def shared_prefix_cache(config: Any, capacity: int) -> SharedPrefixCache | None:
    """A `SharedPrefixCache` reserving `capacity` generated positions per row, or None when this model's
    cache is not one plain `DynamicLayer` per layer (e.g. sliding-window layers)."""
    cache = SharedPrefixCache(config, capacity)
    return cache if cache.plain_layout else None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, sdpa_mask)
