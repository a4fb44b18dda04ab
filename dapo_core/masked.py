"""Masked reductions over padded token tensors (B, L).

These follow the NEWEST reference conventions (docs/REFERENCE.md §Conventions):

- `masked_sum` zeroes entries where the mask is 0 *before* multiplying by the mask, so a NaN or inf
  sitting in padding never leaks into the sum (or into its gradient).
- `masked_mean` divides by `Σ mask + 1e-8`, so an all-masked input gives 0, not NaN.
- `masked_var` is the unbiased (n − 1) variance over the masked entries and refuses n ∈ {0, 1}.
- `masked_whiten` standardises with the masked mean and variance: `(x − mean) · rsqrt(var + 1e-8)`.

All functions keep the dtype of `values` (float32 or float64); the mask may be bool, int or float.
"""

from __future__ import annotations

import torch

__all__ = ["MASKED_MEAN_EPS", "WHITEN_EPS", "masked_mean", "masked_sum", "masked_var", "masked_whiten"]

MASKED_MEAN_EPS = 1e-8
"""Added to the token count in `masked_mean` (same value as the reference)."""

WHITEN_EPS = 1e-8
"""Added to the variance inside the rsqrt of `masked_whiten`."""


def _as_mask(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Return `mask` in the dtype of `values`, checking the shapes broadcast."""
    if not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(mask)
    try:
        torch.broadcast_shapes(mask.shape, values.shape)
    except RuntimeError as err:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not broadcast with values shape {tuple(values.shape)}; "
            "pass the (B, L) response_mask that matches the (B, L) token tensor"
        ) from err
    return mask.to(dtype=values.dtype, device=values.device)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values · mask` over `axis` (all elements when None).

    Entries with `mask == 0` are replaced by 0 before multiplying, so non-finite padding is ignored.
    """
    m = _as_mask(mask, values)
    picked = torch.where(m != 0, values, torch.zeros((), dtype=values.dtype, device=values.device))
    prod = picked * m
    return prod.sum() if axis is None else prod.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the masked entries: `masked_sum / (Σ mask + 1e-8)`.

    With no valid entry the result is 0 (not NaN), because of the epsilon.
    """
    m = _as_mask(mask, values)
    total = masked_sum(values, m, axis)
    count = m.sum() if axis is None else m.sum(dim=axis)
    return total / (count + MASKED_MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over all masked entries (a scalar).

    `mean((x − mean)²)` over the mask, times `n / (n − 1)` when `unbiased` (n = Σ mask). Raises
    ValueError when the mask has no valid entry, or exactly one valid entry and `unbiased` is set.
    """
    m = _as_mask(mask, values)
    mean = masked_mean(values, m)
    centered = values - mean
    variance = masked_mean(centered * centered, m)
    if unbiased:
        n = m.sum()
        if n == 0:
            raise ValueError(
                "masked_var: the mask has no valid entry (Σ mask == 0); whitening needs at least two "
                "valid tokens — drop empty batches before computing advantages"
            )
        if n == 1:
            raise ValueError(
                "masked_var: the mask has exactly one valid entry, so the unbiased variance divides by "
                "zero; use a batch with at least two valid tokens or unbiased=False"
            )
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise `values` with the masked mean and unbiased variance.

    Returns `(x − mean) · rsqrt(var + 1e-8)`; with `shift_mean=False` the mean is added back. Every
    entry (masked or not) is transformed; multiply by the mask afterwards to zero the padding.
    """
    m = _as_mask(mask, values)
    mean = masked_mean(values, m)
    var = masked_var(values, m)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
