"""Rollout-correction diagnostics: IS metrics, per-option RS metrics and off-policy metrics
(docs/REFERENCE.md §§5.2-5.4), plus the small reductions they share with
:mod:`dapo_core.algo.rollout_correction.core`.

Split out of :mod:`dapo_core.algo.rollout_correction.core`, which re-exports every public name defined here;
import them from there. Metric keys are returned without the ``rollout_corr/`` prefix.
"""

from __future__ import annotations

import math

import torch

from dapo_core.algo.rollout_correction.config import _check_rollout_is, parse_is_threshold
from dapo_core.masked import masked_mean as _masked_mean
from dapo_core.masked import masked_sum as _masked_sum

__all__ = [
    "SAFETY_BOUND",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
]

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to ±SAFETY_BOUND before exponentiation (exp(20) ≈ 4.85e8)."""

_EPS = 1e-8


# ----------------------------------------------------------------------------------------------------
# small helpers (masked reductions come from dapo_core.masked, §Conventions)
# ----------------------------------------------------------------------------------------------------


def _f(x: torch.Tensor | float) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _safe_max(x: torch.Tensor) -> float:
    return _f(x.max()) if x.numel() else 0.0


def _safe_min(x: torch.Tensor) -> float:
    return _f(x.min()) if x.numel() else 0.0


def _pop_std(x: torch.Tensor) -> float:
    """Population std of a 1-D tensor (0.0 for fewer than two values)."""
    if x.numel() < 2:
        return 0.0
    mean = x.mean()
    return math.sqrt(max(_f((x * x).mean() - mean * mean), 0.0))


def _masked_pop_std(x: torch.Tensor, mask: torch.Tensor) -> float:
    mean = _masked_mean(x, mask)
    return math.sqrt(max(_f(_masked_mean(x * x, mask) - mean * mean), 0.0))


def _check_pair(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}; "
            "both must be (batch, response_length) over the same right-padded responses"
        )


def _nonempty_rows(response_mask: torch.Tensor) -> torch.Tensor:
    return response_mask.to(torch.float64).sum(dim=-1) > 0


# ----------------------------------------------------------------------------------------------------
# diagnostics: IS, rejection sampling, off-policy
# ----------------------------------------------------------------------------------------------------


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float | str,
    rollout_is_threshold_lower: float | None = None,
) -> dict[str, float]:
    """IS diagnostics (§5.2), keys without prefix: ``rollout_is_{mean,max,min,std,
    eff_sample_size,ratio_fraction_high,ratio_fraction_low}``, ``rollout_is_seq_{mean,std,max,min,
    max_deviation,fraction_high,fraction_low}`` and, for IcePop, ``rollout_is_oob_ratio``.

    ``rollout_is_weights`` are the applied (truncated/masked, un-normalised) weights,
    ``raw_rollout_is_weights`` the weights before truncation. ``log_ratio_for_metrics`` is the token log-ratio
    (token level) or the per-sequence summed log-ratio, shape ``(B,)`` or ``(B, 1)`` (sequence level; a
    ``(B, L)`` tensor with ``L > 1`` is summed over the mask). The lower bound defaults to ``1/upper``.
    Per-sequence statistics use only rows with at least one valid token (deliberate: padding rows are not
    sequences); std values are population stds.
    """
    lower, upper, icepop = parse_is_threshold(rollout_is_threshold)
    if rollout_is_threshold_lower is not None:
        lower = float(rollout_is_threshold_lower)
    if lower is None:
        lower = 1.0 / upper
    _check_rollout_is(rollout_is)
    w = rollout_is_weights.detach()
    raw = raw_rollout_is_weights.detach()
    mask = response_mask
    valid = mask.bool()
    rows = _nonempty_rows(mask)
    metrics: dict[str, float] = {}

    if rollout_is == "sequence":
        lr = log_ratio_for_metrics.detach()
        if lr.dim() == 2 and lr.shape[-1] != 1:
            lr = _masked_sum(lr, mask, axis=-1)
        seq_lr = lr.reshape(-1)[rows]
        log_upper, log_lower = math.log(upper), math.log(lower)
        metrics["rollout_is_mean"] = _f(_masked_mean(w, mask))
        metrics["rollout_is_max"] = math.exp(min(_safe_max(seq_lr), SAFETY_BOUND)) if seq_lr.numel() else 0.0
        metrics["rollout_is_min"] = math.exp(_safe_min(seq_lr)) if seq_lr.numel() else 0.0
        n = max(seq_lr.numel(), 1)
        metrics["rollout_is_ratio_fraction_high"] = _f((seq_lr > log_upper).sum()) / n
        metrics["rollout_is_ratio_fraction_low"] = _f((seq_lr < log_lower).sum()) / n
    else:
        metrics["rollout_is_mean"] = _f(_masked_mean(w, mask))
        metrics["rollout_is_max"] = _safe_max(w[valid])
        metrics["rollout_is_min"] = _safe_min(w[valid])
        metrics["rollout_is_ratio_fraction_high"] = _f(_masked_mean((raw > upper).to(w.dtype), mask))
        metrics["rollout_is_ratio_fraction_low"] = _f(_masked_mean((raw < lower).to(w.dtype), mask))

    # spread and effective sample size of the capped weights
    w_cap = torch.clamp(w, min=0.0, max=upper)
    mean_cap = _masked_mean(w_cap, mask)
    second = _masked_mean(w_cap * w_cap, mask)
    metrics["rollout_is_std"] = math.sqrt(max(_f(second - mean_cap * mean_cap), 0.0))
    normed = w_cap / (mean_cap + _EPS)
    metrics["rollout_is_eff_sample_size"] = _f(1.0 / _masked_mean(normed * normed, mask))

    # per-sequence mean weights (applied for the spread, raw for the tail fractions)
    seq_w = _masked_mean(w, mask, axis=-1)[rows]
    seq_raw = _masked_mean(raw, mask, axis=-1)[rows]
    n_rows = max(seq_w.numel(), 1)
    metrics["rollout_is_seq_mean"] = _f(seq_w.mean()) if seq_w.numel() else 0.0
    metrics["rollout_is_seq_std"] = _pop_std(seq_w)
    metrics["rollout_is_seq_max"] = _safe_max(seq_w)
    metrics["rollout_is_seq_min"] = _safe_min(seq_w)
    metrics["rollout_is_seq_max_deviation"] = _safe_max((seq_w - 1.0).abs())
    metrics["rollout_is_seq_fraction_high"] = _f((seq_raw > upper).sum()) / n_rows
    metrics["rollout_is_seq_fraction_low"] = _f((seq_raw < lower).sum()) / n_rows
    if icepop:
        oob = ((raw < lower) | (raw > upper)).to(w.dtype)
        metrics["rollout_is_oob_ratio"] = _f(_masked_mean(oob, mask))
    return metrics


def _rs_option_metrics(
    prefix: str,
    stat: torch.Tensor,
    lower: float | None,
    upper: float,
    keep: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    valid = mask.bool()
    rows = _nonempty_rows(mask)
    dtype = stat.dtype
    m: dict[str, float] = {}
    if stat.dim() == 2:  # token option
        vals = stat[valid]
        m[f"{prefix}_mean"] = _f(_masked_mean(stat, mask))
        m[f"{prefix}_max"] = _safe_max(vals)
        m[f"{prefix}_min"] = _safe_min(vals)
        m[f"{prefix}_std"] = _masked_pop_std(stat, mask)
        m[f"{prefix}_fraction_high"] = _f(_masked_mean((stat > upper).to(dtype), mask))
        low = (stat < lower).to(dtype) if lower is not None else torch.zeros_like(stat)
        m[f"{prefix}_fraction_low"] = _f(_masked_mean(low, mask))
        seq = _masked_mean(stat, mask, axis=-1)[rows]
    else:  # sequence option
        seq = stat[rows]
        m[f"{prefix}_mean"] = _f(seq.mean()) if seq.numel() else 0.0
        m[f"{prefix}_max"] = _safe_max(seq)
        m[f"{prefix}_min"] = _safe_min(seq)
        m[f"{prefix}_std"] = _pop_std(seq)
        n = max(seq.numel(), 1)
        m[f"{prefix}_fraction_high"] = _f((seq > upper).sum()) / n
        m[f"{prefix}_fraction_low"] = _f((seq < lower).sum()) / n if lower is not None else 0.0
    n_rows = max(seq.numel(), 1)
    m[f"{prefix}_seq_mean"] = _f(seq.mean()) if seq.numel() else 0.0
    m[f"{prefix}_seq_std"] = _pop_std(seq)
    m[f"{prefix}_seq_max"] = _safe_max(seq)
    m[f"{prefix}_seq_min"] = _safe_min(seq)
    m[f"{prefix}_seq_max_deviation"] = _safe_max(seq.abs())
    m[f"{prefix}_seq_fraction_high"] = _f((seq > upper).sum()) / n_rows
    if lower is not None:
        m[f"{prefix}_seq_fraction_low"] = _f((seq < lower).sum()) / n_rows
    rejected = (~keep) & valid
    m[f"{prefix}_masked_fraction"] = _f(_masked_mean(rejected.to(dtype), mask))
    m[f"{prefix}_seq_masked_fraction"] = (
        _f(rejected.any(dim=-1).to(dtype).mean()) if rejected.numel() else 0.0
    )
    return m


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Off-policy diagnostics (§5.4), keys without prefix.

    Always ``training_ppl`` (mean over sequences of ``exp(−mean_t old_logp)``) and ``training_log_ppl``; with
    rollout log-probs also ``kl`` (= masked mean of ``rollout − old``), ``k3_kl``, ``rollout_ppl``,
    ``rollout_log_ppl``, ``log_ppl_diff`` (mean over sequences of ``mean_t rollout − mean_t old``),
    ``log_ppl_abs_diff``, ``log_ppl_diff_max/min``, ``ppl_ratio``, ``chi2_token`` and ``chi2_seq``.
    Sequence means run over rows with at least one valid token (deliberate: padding rows are ignored).
    """
    old = old_log_prob.detach()
    mask = response_mask
    rows = _nonempty_rows(mask)
    metrics: dict[str, float] = {}
    old_mean = _masked_mean(old, mask, axis=-1)[rows]
    if old_mean.numel() == 0:
        return metrics
    metrics["training_ppl"] = _f(torch.exp(-old_mean).mean())
    metrics["training_log_ppl"] = _f((-old_mean).mean())
    if rollout_log_prob is None:
        return metrics
    _check_pair(old_log_prob, rollout_log_prob, "old_log_prob", "rollout_log_prob")
    rollout = rollout_log_prob.detach()
    lr = old - rollout
    metrics["kl"] = _f(_masked_mean(rollout - old, mask))
    metrics["k3_kl"] = _f(_masked_mean(torch.exp(lr) - lr - 1.0, mask))
    rollout_mean = _masked_mean(rollout, mask, axis=-1)[rows]
    metrics["rollout_ppl"] = _f(torch.exp(-rollout_mean).mean())
    metrics["rollout_log_ppl"] = _f((-rollout_mean).mean())
    diff = rollout_mean - old_mean
    metrics["log_ppl_diff"] = _f(diff.mean())
    metrics["log_ppl_abs_diff"] = _f(diff.abs().mean())
    metrics["log_ppl_diff_max"] = _f(diff.max())
    metrics["log_ppl_diff_min"] = _f(diff.min())
    metrics["ppl_ratio"] = _f(torch.exp(diff).mean())
    clamped = torch.clamp(lr, -SAFETY_BOUND, SAFETY_BOUND)
    metrics["chi2_token"] = _f(_masked_mean(torch.exp(2.0 * clamped), mask) - 1.0)
    seq_lr = torch.clamp(_masked_sum(lr, mask, axis=-1)[rows], -SAFETY_BOUND, SAFETY_BOUND)
    metrics["chi2_seq"] = _f(torch.exp(2.0 * seq_lr).mean() - 1.0)
    return metrics
