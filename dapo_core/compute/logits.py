"""Per-token log-probs and entropy from logits, in blocks, so a real vocabulary does not multiply memory.

The float32 arithmetic of a (rows × length × V) logit tensor needs several temporaries of its size (the cast,
log-softmax, softmax, softmax × logits): at V = 49,152, 64 rows and 128 positions each is 1.6 GB. Above
`CHUNK_ELEMENTS` logits, `token_log_probs` and `token_entropy` walk the tensor in blocks of whole rows (or of
positions within a row when one row is larger than a block), slicing views, never copying the input; each
block's temporaries are freed before the next. With gradients each block runs under activation
checkpointing (recomputed in backward), so backward too holds one block's temporaries at a time.

Each block uses exactly the formulas of the unblocked computation (`log_softmax` then `gather`;
`logsumexp(z) − Σ softmax(z)·z`), which are row-wise, so blocking does not change a value. At or below the
threshold the tensor is one block: the tiny CPU default never blocks.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

__all__ = ["CHUNK_ELEMENTS", "block_log_probs", "token_entropy", "token_log_probs"]

CHUNK_ELEMENTS = 1 << 24
"""Logits per block (16 Mi: 64 MiB per float32 temporary; 341 positions at V = 49,152)."""


def block_log_probs(
    z: torch.Tensor, labels: torch.Tensor, temperature: float, calculate_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `labels` and entropy (empty unless asked) of one block `z` (..., V), in float32 (float64
    for float64 logits): the unblocked formulas."""
    z = z.double() if z.dtype == torch.float64 else z.float()
    if temperature != 1.0:
        z = z / temperature
    log_probs = torch.log_softmax(z, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = _entropy(z) if calculate_entropy else log_probs.new_zeros(0)
    return log_probs, entropy


def _entropy(z: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)


def _blocks(shape: torch.Size, vocab: int, chunk_elements: int) -> list[tuple[slice, slice]]:
    """(row slice, position slice) blocks of a (B, T) grid, each at most `chunk_elements` logits (at least one
    position)."""
    B, T = int(shape[0]), int(shape[1])
    per_row = max(T * vocab, 1)
    if per_row <= chunk_elements:
        rows = max(1, chunk_elements // per_row)
        return [(slice(b, min(b + rows, B)), slice(0, T)) for b in range(0, B, rows)]
    width = max(1, chunk_elements // max(vocab, 1))
    return [(slice(b, b + 1), slice(t, min(t + width, T))) for b in range(B) for t in range(0, T, width)]


def _as_3d(x: torch.Tensor, vocab_dim: bool) -> torch.Tensor:
    """View `x` as (B, T[, V]): leading dims of a 1-D grid become (1, N); of a ≥3-D grid, (prod, last)."""
    lead = x.dim() - (1 if vocab_dim else 0)
    if lead == 1:
        return x.unsqueeze(0)
    if lead == 2:
        return x
    return x.flatten(0, lead - 2)


def token_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` (shape S) under `logits / temperature` (shape S × V), and the entropy (shape S)
    when asked; float32 (float64 for float64 logits). Above `chunk_elements` logits, computed block by block
    (checkpointed when gradients flow)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"token_log_probs: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}"
        )
    if labels.numel() * logits.shape[-1] <= chunk_elements:
        lp, ent = block_log_probs(logits, labels, temperature, calculate_entropy)
        return lp, (ent if calculate_entropy else None)
    z3, y2 = _as_3d(logits, True), _as_3d(labels, False)
    grad = torch.is_grad_enabled() and logits.requires_grad
    lp_rows, ent_rows = [], []
    blocks = _blocks(y2.shape, int(logits.shape[-1]), chunk_elements)
    row_lp: list[torch.Tensor] = []
    row_ent: list[torch.Tensor] = []
    for i, (rs, ts) in enumerate(blocks):
        args = (z3[rs, ts], y2[rs, ts], temperature, calculate_entropy)
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(block_log_probs, *args, use_reentrant=False)
        else:
            lp, ent = block_log_probs(*args)
        row_lp.append(lp)
        row_ent.append(ent)
        if i + 1 == len(blocks) or blocks[i + 1][0] != rs:  # the row block is complete
            lp_rows.append(torch.cat(row_lp, dim=1))
            ent_rows.append(torch.cat(row_ent, dim=1) if calculate_entropy else None)
            row_lp, row_ent = [], []
    log_probs = torch.cat(lp_rows, dim=0).reshape(labels.shape)
    entropy = torch.cat(ent_rows, dim=0).reshape(labels.shape) if calculate_entropy else None  # type: ignore[arg-type]
    return log_probs, entropy


def token_entropy(logits: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Entropy over the last dim, `logsumexp(z) − Σ softmax(z)·z`, in the dtype of `logits`; above
    `chunk_elements` logits block by block (checkpointed when gradients flow)."""
    if logits.numel() <= chunk_elements or logits.dim() < 2:
        return _entropy(logits)
    z3 = _as_3d(logits, True)
    grad = torch.is_grad_enabled() and logits.requires_grad
    out_rows, row = [], []
    blocks = _blocks(z3.shape[:2], int(logits.shape[-1]), chunk_elements)
    for i, (rs, ts) in enumerate(blocks):
        part = z3[rs, ts]
        row.append(
            torch.utils.checkpoint.checkpoint(_entropy, part, use_reentrant=False) if grad else _entropy(part)
        )
        if i + 1 == len(blocks) or blocks[i + 1][0] != rs:
            out_rows.append(torch.cat(row, dim=1))
            row = []
    return torch.cat(out_rows, dim=0).reshape(logits.shape[:-1])
