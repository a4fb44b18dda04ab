"""Rollout correction: importance sampling (IS) and rejection sampling (RS) for the mismatch between the
rollout engine (π_rollout) and the trainer (π_train) (docs/REFERENCE.md §5, NEWEST).

* ``log_ratio = old_log_prob − rollout_log_prob``. In *decoupled* mode π_train is the recomputed old policy;
  in *bypass* mode (``old_log_probs := rollout_log_probs``) the policy loss calls
  :func:`compute_rollout_correction_and_rejection_mask` per micro-batch against π_θ itself, so
  :func:`apply_rollout_correction` computes no weights and leaves the mask alone.
* IS weights (:func:`compute_rollout_correction_weights`): token or sequence level, truncated (TIS) or masked
  (IcePop, ``"lower_upper"``), optionally batch-normalised to mean 1; detached.
* RS (:func:`compute_rollout_rejection_mask`): k1/k2/k3 divergence per token, per-sequence sum, mean or max;
  options combine with AND and only edit the response mask (RS never zeroes weights).
* Diagnostics (:func:`compute_is_metrics`, :func:`compute_offpolicy_metrics`): keys under ``rollout_corr/``.

Pure torch. :mod:`.config` (options, presets) and :mod:`.metrics` are re-exported: import from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dapo_core.algo.rollout_correction.config import (
    PRESETS,
    SUPPORTED_LOSS_TYPES,
    SUPPORTED_ROLLOUT_IS_LEVELS,
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    RolloutCorrection,
    _check_rollout_is,
    parse_is_threshold,
    parse_rs_option_names,
    parse_rs_options,
)
from dapo_core.algo.rollout_correction.metrics import (
    _EPS,
    SAFETY_BOUND,
    _check_pair,
    _f,
    _nonempty_rows,
    _rs_option_metrics,
    compute_is_metrics,
    compute_offpolicy_metrics,
)
from dapo_core.masked import masked_mean as _masked_mean
from dapo_core.masked import masked_sum as _masked_sum

__all__ = [
    "PRESETS",
    "SAFETY_BOUND",
    "SUPPORTED_LOSS_TYPES",
    "SUPPORTED_ROLLOUT_IS_LEVELS",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "RolloutCorrection",
    "apply_rollout_correction",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "parse_is_threshold",
    "parse_rs_option_names",
    "parse_rs_options",
]


# ----------------------------------------------------------------------------------------------------
# IS weights
# ----------------------------------------------------------------------------------------------------


def _global_masked_mean(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over all data-parallel ranks when torch.distributed is initialised, else local."""
    total = _masked_sum(w, mask)
    count = mask.to(w.dtype).sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        buf = torch.stack([total, count])
        torch.distributed.all_reduce(buf)
        total, count = buf[0], buf[1]
    return total / (count + _EPS)


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """IS weights ``π_train/π_rollout`` (§5.2) and their metrics (no prefix).

    ``token``: ``w_t = exp(clamp(log_ratio_t, ±20))``; ``sequence``: ``w_i = exp(clamp(Σ_t log_ratio_t,
    ±20))`` broadcast over the row. Then ``w ← w·mask``; TIS caps at ``upper``; IcePop (``"lower_upper"``)
    zeroes weights outside ``[lower, upper]`` (the mask is unchanged). Metrics are computed on the truncated
    weights *before* batch normalisation; normalisation (optional) divides by the masked token mean (all
    ranks) at token level or by the mean per-sequence weight over non-empty rows at sequence level, only if
    that mean > 1e-8, so normalised weights may exceed the cap. The returned weights are detached.
    """
    _check_rollout_is(rollout_is)
    if rollout_is is None:
        raise ValueError("rollout_is is None: IS weights are off; call with rollout_is='token' or 'sequence'")
    _check_pair(log_ratio, response_mask, "log_ratio", "response_mask")
    lower, upper, icepop = parse_is_threshold(rollout_is_threshold)
    log_ratio = log_ratio.detach()
    mask_f = response_mask.to(log_ratio.dtype)

    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        seq_log_ratio = _masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        log_ratio_for_metrics = seq_log_ratio
        raw = torch.exp(torch.clamp(seq_log_ratio, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    # ``w · mask``, but with masked entries replaced by 0 first (reference masked_sum convention): a NaN
    # log-prob in padding must not become a NaN weight, whose product with the loss would put NaN into the
    # gradient.
    raw = torch.where(response_mask.bool(), raw * mask_f, torch.zeros((), dtype=raw.dtype))

    if icepop:
        assert lower is not None  # parse_is_threshold gives a lower bound for every IcePop range
        keep = (raw >= lower) & (raw <= upper)
        weights = torch.where(keep, raw, torch.zeros((), dtype=raw.dtype))
    else:
        weights = torch.clamp(raw, max=upper)

    metrics = compute_is_metrics(
        rollout_is_weights=weights,
        raw_rollout_is_weights=raw,
        log_ratio_for_metrics=log_ratio_for_metrics,
        response_mask=response_mask,
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_threshold_lower=lower,
    )

    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = _global_masked_mean(weights, response_mask)
        else:
            rows = _nonempty_rows(response_mask)
            seq_w = _masked_mean(weights, response_mask, axis=-1)[rows]
            mean = seq_w.mean() if seq_w.numel() else torch.zeros((), dtype=weights.dtype)
        if _f(mean) > _EPS:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = _f(mean)
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights.detach(), metrics


# ----------------------------------------------------------------------------------------------------
# rejection sampling
# ----------------------------------------------------------------------------------------------------


def _rs_statistic(option: str, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The option's statistic: ``(B, L)`` for token options, ``(B,)`` for sequence options."""
    x = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    kind = option[-2:]
    if kind == "k1":
        per_token = -x
    elif kind == "k2":
        per_token = 0.5 * x * x
    else:
        per_token = torch.exp(x) - 1.0 - x
    if option.startswith("token_"):
        return per_token
    if option.startswith("seq_sum_"):
        return _masked_sum(per_token, mask, axis=-1)
    if option.startswith("seq_mean_"):
        return _masked_mean(per_token, mask, axis=-1)
    # seq_max: k2/k3 are >= 0, so filling invalid positions with 0 makes an empty row's max 0
    filled = torch.where(mask.bool(), per_token, torch.zeros((), dtype=per_token.dtype))
    return filled.max(dim=-1).values


def _apply_keep(response_mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    if response_mask.dtype == torch.bool:
        return response_mask & keep
    return response_mask * keep.to(response_mask.dtype)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str | Sequence[str] = "token_k1",
    rollout_rs_threshold: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection sampling (§5.3): returns ``(response_mask · keep, metrics)`` (metrics without prefix).

    With ``x = clamp(log_ratio, ±20)`` the per-token statistics are ``k1 = −x``, ``k2 = x²/2``,
    ``k3 = exp(x) − 1 − x``. Token options drop offending tokens; ``seq_sum``/``seq_mean``/``seq_max`` options
    drop whole rows. k1 keeps ``log(lower) <= stat <= log(upper)`` (because ``k1 = −log r`` the bounds
    constrain π_rollout/π_train; asymmetric specs are mirrored relative to π_train/π_rollout); k2/k3 keep
    ``stat <= upper``. Options combine with AND. The returned mask has the input's dtype; an empty batch
    returns the mask unchanged.
    """
    _check_pair(log_ratio, response_mask, "log_ratio", "response_mask")
    parsed = parse_rs_options(rollout_rs, rollout_rs_threshold)
    if response_mask.numel() == 0:
        return response_mask, {}
    log_ratio = log_ratio.detach()
    valid = response_mask.bool()
    keep_all = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    for option, lower, upper in parsed:
        stat = _rs_statistic(option, log_ratio, response_mask)
        ok = stat <= upper
        if lower is not None:
            ok = ok & (stat >= lower)
        keep = ok if stat.dim() == 2 else ok.unsqueeze(-1).expand_as(valid)
        metrics.update(_rs_option_metrics(f"rollout_rs_{option}", stat, lower, upper, keep, response_mask))
        keep_all = keep_all & keep
    rejected = (~keep_all) & valid
    dtype = log_ratio.dtype
    metrics["rollout_rs_masked_fraction"] = _f(_masked_mean(rejected.to(dtype), response_mask))
    metrics["rollout_rs_seq_masked_fraction"] = _f(rejected.any(dim=-1).to(dtype).mean())
    return _apply_keep(response_mask, keep_all), metrics


# ----------------------------------------------------------------------------------------------------
# off-policy diagnostics and the unified entry
# ----------------------------------------------------------------------------------------------------


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | Sequence[str] | None = None,
    rollout_rs_threshold: Any = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Unified IS + RS entry (§5.4): ``(rollout_is_weights | None, modified_response_mask, metrics)``.

    IS runs only if ``rollout_is`` and ``rollout_is_threshold`` are both set; RS only if ``rollout_rs`` is set
    (``None`` or ``""`` = off) and then needs ``rollout_rs_threshold``. RS acts only through the mask (IS
    weights are not zeroed). Off-policy diagnostics are always included. Every key is prefixed
    ``rollout_corr/``. Unlike verl the weights tensor is returned directly rather than wrapped in a DataProto.
    """
    _check_pair(old_log_prob, rollout_log_prob, "old_log_prob", "rollout_log_prob")
    _check_pair(old_log_prob, response_mask, "old_log_prob", "response_mask")
    if not bool(response_mask.bool().any()):
        raise ValueError(
            "response_mask has no valid token; rollout correction needs at least one generated token "
            "(drop empty batches before calling it)"
        )
    _check_rollout_is(rollout_is)
    log_ratio = (old_log_prob - rollout_log_prob).detach()
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio,
            response_mask,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    modified_mask = response_mask
    if rollout_rs is not None and not (isinstance(rollout_rs, str) and not rollout_rs.strip()):
        modified_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, modified_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def apply_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrection | Mapping[str, Any] | None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Driver-side rollout correction for one training batch: ``(weights | None, response_mask, metrics)``.

    Decoupled mode: IS/RS computed once against the recomputed π_old (the caller stores the mask as the new
    ``response_mask`` *before* computing advantages, and passes the weights to the policy loss).
    Bypass mode: the caller sets ``old_log_probs := rollout_log_probs`` and the bypass policy loss recomputes
    IS/RS per micro-batch against the current π_θ; here only the off-policy diagnostics are returned, with no
    weights and the mask unchanged. ``cfg=None`` means :meth:`RolloutCorrection.disabled`.
    """
    if not isinstance(cfg, RolloutCorrection):
        cfg = RolloutCorrection.from_dict(cfg)
    if cfg.bypass_mode:
        _check_pair(old_log_prob, rollout_log_prob, "old_log_prob", "rollout_log_prob")
        metrics = compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)
        return None, response_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
    return compute_rollout_correction_and_rejection_mask(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        rollout_is=cfg.rollout_is,
        rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_is_batch_normalize=cfg.rollout_is_batch_normalize,
        rollout_rs=cfg.rollout_rs,
        rollout_rs_threshold=cfg.rollout_rs_threshold,
    )
