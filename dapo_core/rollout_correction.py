"""Rollout correction: importance sampling (IS) and rejection sampling (RS) for the
training/inference mismatch between the rollout engine (π_rollout) and the trainer (π_train).

What this module does (reference §5, NEWEST):

* ``log_ratio = old_log_prob − rollout_log_prob`` = log π_train/π_rollout. In *decoupled* mode π_train is the
  recomputed old policy; in *bypass* mode the caller sets ``old_log_probs := rollout_log_probs`` and the policy
  loss recomputes IS/RS per micro-batch against the current π_θ by calling
  :func:`compute_rollout_correction_and_rejection_mask` itself (so :func:`apply_rollout_correction` computes no
  weights and leaves the mask alone in bypass mode).
* IS weights (:func:`compute_rollout_correction_weights`): token or sequence level, truncated (TIS, a single
  upper cap) or masked (IcePop, ``"lower_upper"``), optionally batch-normalised to mean 1. Weights are detached.
* RS (:func:`compute_rollout_rejection_mask`): k1/k2/k3 divergence statistics per token, per-sequence sum,
  mean or max; options combine with AND and only edit the response mask (weights are never zeroed by RS).
* Diagnostics (:func:`compute_is_metrics`, :func:`compute_offpolicy_metrics`); the unified entry prefixes every
  key with ``rollout_corr/``.

Pure torch, float32 and float64; no Prefect, no DataProto (the weights tensor is returned directly).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from dapo_core.masked import masked_mean as _masked_mean
from dapo_core.masked import masked_sum as _masked_sum

__all__ = [
    "SAFETY_BOUND",
    "SUPPORTED_LOSS_TYPES",
    "SUPPORTED_ROLLOUT_IS_LEVELS",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "RolloutCorrectionConfig",
    "apply_rollout_correction",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "parse_is_threshold",
    "parse_rs_options",
]

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to ±SAFETY_BOUND before exponentiation (exp(20) ≈ 4.85e8)."""

SUPPORTED_ROLLOUT_IS_LEVELS = ("token", "sequence")
"""Valid values of ``rollout_is`` besides ``None`` (off)."""

SUPPORTED_ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""Rejection-sampling options: ``{token|seq_sum|seq_mean|seq_max}_k{1,2,3}`` (no ``seq_max_k1``)."""

SUPPORTED_LOSS_TYPES = ("ppo_clip", "reinforce")
"""Bypass-mode policy losses."""

_EPS = 1e-8


# ----------------------------------------------------------------------------------------------------
# small helpers (masked reductions come from dapo_core.masked, reference §Conventions)
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


# ----------------------------------------------------------------------------------------------------
# threshold parsing
# ----------------------------------------------------------------------------------------------------


def _parse_positive(value: str, field: str) -> float:
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"{field}={value!r} is not a number; use e.g. 2.0 or '0.5_2.0'") from None
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{field}={value!r} must be a finite number > 0")
    return out


def parse_is_threshold(rollout_is_threshold: float | str) -> tuple[float | None, float, bool]:
    """Parse ``rollout_is_threshold`` into ``(lower, upper, is_icepop)``.

    A number or a number-string is a TIS upper cap (``lower=None``); a ``"lower_upper"`` string selects IcePop
    masking with both bounds. Bools raise ``TypeError`` (``True`` is not a cap); the bounds must satisfy
    ``0 < lower <= upper``.
    """
    if isinstance(rollout_is_threshold, bool):
        raise TypeError(
            f"rollout_is_threshold={rollout_is_threshold!r} is not a boolean setting: give an upper cap such "
            "as 2.0, a 'lower_upper' string such as '0.5_5.0', or set rollout_is=null to disable IS"
        )
    if isinstance(rollout_is_threshold, (int, float)):
        return None, _parse_positive(str(rollout_is_threshold), "rollout_is_threshold"), False
    if not isinstance(rollout_is_threshold, str):
        raise TypeError(
            f"rollout_is_threshold must be a float or a string, got {type(rollout_is_threshold).__name__}"
        )
    text = rollout_is_threshold.strip()
    if not text:
        raise ValueError("rollout_is_threshold is an empty string; use e.g. 2.0 or '0.5_5.0'")
    if "_" in text:
        parts = text.split("_")
        if len(parts) != 2:
            raise ValueError(f"rollout_is_threshold={text!r} must be 'lower_upper', e.g. '0.5_5.0'")
        lower = _parse_positive(parts[0], "rollout_is_threshold (lower)")
        upper = _parse_positive(parts[1], "rollout_is_threshold (upper)")
        if lower > upper:
            raise ValueError(f"rollout_is_threshold={text!r}: lower {lower} must be <= upper {upper}")
        return lower, upper, True
    return None, _parse_positive(text, "rollout_is_threshold"), False


def _split_spec(spec: Any, field: str) -> list[str]:
    if isinstance(spec, bool):
        raise TypeError(f"{field}={spec!r} is not a boolean setting; give option names / thresholds")
    if isinstance(spec, (int, float)):
        return [str(spec)]
    if isinstance(spec, str):
        items = [s.strip() for s in spec.split(",")]
    elif isinstance(spec, Sequence):
        items = []
        for s in spec:
            items.extend(_split_spec(s, field))
    else:
        raise TypeError(f"{field} must be a string, a number or a list, got {type(spec).__name__}")
    if not items or any(not s for s in items):
        raise ValueError(f"{field}={spec!r} has an empty entry; use comma-separated values without blanks")
    return items


def _parse_rs_bound(option: str, spec: str) -> tuple[float | None, float]:
    """Bounds in *statistic* space: ``(log lower, log upper)`` for k1, ``(None, upper)`` for k2/k3."""
    if option.endswith("k1"):
        if "_" in spec:
            parts = spec.split("_")
            if len(parts) != 2:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option} must be 'lower_upper'")
            lower = _parse_positive(parts[0], f"rollout_rs_threshold (lower, {option})")
            upper = _parse_positive(parts[1], f"rollout_rs_threshold (upper, {option})")
        else:
            upper = _parse_positive(spec, f"rollout_rs_threshold ({option})")
            lower = 1.0 / upper
        if lower > upper:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: lower {lower} must be <= upper {upper}")
        return math.log(lower), math.log(upper)
    if "_" in spec:
        raise ValueError(
            f"rollout_rs_threshold {spec!r} for {option}: k2/k3 options take a single upper bound "
            "(e.g. 0.01), not 'lower_upper'"
        )
    return None, _parse_positive(spec, f"rollout_rs_threshold ({option})")


def parse_rs_options(
    rollout_rs: str | Sequence[str], rollout_rs_threshold: Any
) -> list[tuple[str, float | None, float]]:
    """Parse RS options and thresholds into ``[(option, lower_bound, upper_bound), ...]``.

    Options are comma-separated (or a list); duplicates are dropped keeping the first. Thresholds are one spec
    shared by all options or exactly one per listed option. Bounds are returned in statistic space: for k1 they
    are ``log(lower), log(upper)`` of the ratio bound (a single number ``u`` means ``[1/u, u]``); for k2/k3 the
    lower bound is ``None``.
    """
    options = _split_spec(rollout_rs, "rollout_rs")
    for opt in options:
        if opt not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            close = difflib.get_close_matches(opt, SUPPORTED_ROLLOUT_RS_OPTIONS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"rollout_rs option {opt!r} is not supported{hint}; choose from {list(SUPPORTED_ROLLOUT_RS_OPTIONS)}"
            )
    if rollout_rs_threshold is None:
        raise ValueError(
            f"rollout_rs={rollout_rs!r} is enabled but rollout_rs_threshold is None; set e.g. "
            "rollout_rs_threshold='0.999_1.001' (k1) or 0.01 (k2/k3)"
        )
    specs = _split_spec(rollout_rs_threshold, "rollout_rs_threshold")
    if len(specs) == 1:
        specs = specs * len(options)
    elif len(specs) != len(options):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} values for {len(options)} rollout_rs options; "
            "give one value shared by all options or exactly one per option"
        )
    out: list[tuple[str, float | None, float]] = []
    seen: set[str] = set()
    for opt, spec in zip(options, specs):
        if opt in seen:
            continue
        seen.add(opt)
        lo, hi = _parse_rs_bound(opt, spec)
        out.append((opt, lo, hi))
    return out


def _check_rollout_is(rollout_is: str | None) -> None:
    if rollout_is is not None and rollout_is not in SUPPORTED_ROLLOUT_IS_LEVELS:
        raise ValueError(
            f"rollout_is={rollout_is!r} is not supported; use null (off), 'token' or 'sequence'"
        )


# ----------------------------------------------------------------------------------------------------
# IS weights
# ----------------------------------------------------------------------------------------------------


def _nonempty_rows(response_mask: torch.Tensor) -> torch.Tensor:
    return response_mask.to(torch.float64).sum(dim=-1) > 0


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float | str,
    rollout_is_threshold_lower: float | None = None,
) -> dict[str, float]:
    """IS diagnostics (reference §5.2), keys without prefix: ``rollout_is_{mean,max,min,std,
    eff_sample_size,ratio_fraction_high,ratio_fraction_low}``, ``rollout_is_seq_{mean,std,max,min,max_deviation,
    fraction_high,fraction_low}`` and, for IcePop, ``rollout_is_oob_ratio``.

    ``rollout_is_weights`` are the applied (truncated/masked, un-normalised) weights, ``raw_rollout_is_weights``
    the weights before truncation. ``log_ratio_for_metrics`` is the token log-ratio (token level) or the
    per-sequence summed log-ratio, shape ``(B,)`` or ``(B, 1)`` (sequence level; a ``(B, L)`` tensor with
    ``L > 1`` is summed over the mask). The lower bound defaults to ``1/upper``.
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
    """IS weights ``π_train/π_rollout`` (reference §5.2) and their metrics (no prefix).

    ``token``: ``w_t = exp(clamp(log_ratio_t, ±20))``; ``sequence``: ``w_i = exp(clamp(Σ_t log_ratio_t, ±20))``
    broadcast over the row. Then ``w ← w·mask``; TIS caps at ``upper``; IcePop (``"lower_upper"``) zeroes weights
    outside ``[lower, upper]`` (the mask is unchanged). Metrics are computed on the truncated weights *before*
    batch normalisation; normalisation (optional) divides by the masked token mean (all ranks) at token level or
    by the mean per-sequence weight over non-empty rows at sequence level, only if that mean > 1e-8, so
    normalised weights may exceed the cap. The returned weights are detached.
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
    # ``w · mask``, but with masked entries replaced by 0 first (reference masked_sum convention): a NaN log-prob
    # in padding must not become a NaN weight, whose product with the loss would put NaN into the gradient.
    raw = torch.where(response_mask.bool(), raw * mask_f, torch.zeros((), dtype=raw.dtype))

    if icepop:
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
    m[f"{prefix}_seq_masked_fraction"] = _f(rejected.any(dim=-1).to(dtype).mean()) if rejected.numel() else 0.0
    return m


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
    """Rejection sampling (reference §5.3): returns ``(response_mask · keep, metrics)`` (metrics without prefix).

    With ``x = clamp(log_ratio, ±20)`` the per-token statistics are ``k1 = −x``, ``k2 = x²/2``,
    ``k3 = exp(x) − 1 − x``. Token options drop offending tokens; ``seq_sum``/``seq_mean``/``seq_max`` options
    drop whole rows. k1 keeps ``log(lower) <= stat <= log(upper)`` (because ``k1 = −log r`` the bounds constrain
    π_rollout/π_train; asymmetric specs are mirrored relative to π_train/π_rollout); k2/k3 keep ``stat <= upper``.
    Options combine with AND. The returned mask has the input's dtype; an empty batch returns the mask unchanged.
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


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Off-policy diagnostics (reference §5.4), keys without prefix.

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
    """Unified IS + RS entry (reference §5.4): ``(rollout_is_weights | None, modified_response_mask, metrics)``.

    IS runs only if ``rollout_is`` and ``rollout_is_threshold`` are both set; RS only if ``rollout_rs`` is set
    (``None`` or ``""`` = off) and then needs ``rollout_rs_threshold``. RS acts only through the mask (IS weights
    are not zeroed). Off-policy diagnostics are always included. Every key is prefixed ``rollout_corr/``.
    Unlike verl the weights tensor is returned directly rather than wrapped in a DataProto.
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


# ----------------------------------------------------------------------------------------------------
# config and presets
# ----------------------------------------------------------------------------------------------------


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction`` (reference §5.1).

    Note the dataclass default ``rollout_is="sequence"`` follows verl's dataclass, while the YAML default in
    ``configs/dapo.yaml`` is ``null`` (IS off); use :meth:`disabled` or ``from_dict`` of the YAML section.
    """

    rollout_is: str | None = "sequence"
    """IS level: None (off), "token" or "sequence"."""
    rollout_is_threshold: float | str = 2.0
    """TIS upper cap (number / number-string) or IcePop bounds "lower_upper"."""
    rollout_is_batch_normalize: bool = False
    """Rescale the IS weights to mean 1 (after truncation)."""
    rollout_rs: str | None = None
    """Comma-separated rejection-sampling options (see SUPPORTED_ROLLOUT_RS_OPTIONS); None = off."""
    rollout_rs_threshold: float | str | None = None
    """One RS threshold spec shared by all options, or one per option (comma-separated)."""
    bypass_mode: bool = False
    """False: decoupled (3 policies, recomputed old log-probs); True: bypass (old := rollout log-probs)."""
    loss_type: str = "ppo_clip"
    """Bypass-mode loss: "ppo_clip" (ratio π_θ/π_rollout, no IS weights) or "reinforce" (−w·A·log π_θ)."""

    def __post_init__(self) -> None:
        _check_rollout_is(self.rollout_is)
        if self.rollout_is is not None:
            parse_is_threshold(self.rollout_is_threshold)
        elif isinstance(self.rollout_is_threshold, bool):
            parse_is_threshold(self.rollout_is_threshold)  # raises the TypeError
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"rollout_correction.loss_type={self.loss_type!r} is not supported; use 'ppo_clip' or 'reinforce'"
            )
        if self.rollout_rs is not None and str(self.rollout_rs).strip():
            parse_rs_options(self.rollout_rs, self.rollout_rs_threshold)

    # -- (de)serialisation ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RolloutCorrectionConfig:
        """Build from a mapping (e.g. the YAML section); unknown keys raise naming the closest field.

        Missing keys take the dataclass defaults; ``None`` yields :meth:`disabled`.
        """
        if data is None:
            return cls.disabled()
        names = [f.name for f in fields(cls)]
        items = dict(data.items())
        for key in items:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"rollout_correction has no field {key!r}{hint} (fields: {names})")
        return cls(**items)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view (round-trips through :meth:`from_dict`)."""
        return asdict(self)

    # -- presets (reference §5.6; exact values) --------------------------------------------------------

    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled, token-level truncated IS."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled, sequence-level truncated IS."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> RolloutCorrectionConfig:
        """Decoupled, token-level IcePop (weights outside [lower, upper] set to 0)."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @classmethod
    def decoupled_seq_is_rs(
        cls, is_threshold: float = 2.0, rs_threshold: float | str = "0.5_2.0"
    ) -> RolloutCorrectionConfig:
        """Decoupled, sequence TIS plus sequence-sum k1 rejection."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_sum_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: float | str = "0.999_1.001") -> RolloutCorrectionConfig:
        """Decoupled, geometric-mean (seq_mean_k1) rejection only."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float | str = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Decoupled, geometric rejection plus sequence TIS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float | str = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Decoupled, geometric rejection plus token TIS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
        """Decoupled, sequence-mean k3 rejection only."""
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
        """Decoupled, sequence-mean k3 rejection plus sequence TIS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def decoupled_k3_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
    ) -> RolloutCorrectionConfig:
        """Decoupled, sequence-mean k3 rejection plus token TIS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
        )

    @classmethod
    def bypass_ppo_clip(cls) -> RolloutCorrectionConfig:
        """Bypass, PPO clip with ratio π_θ/π_rollout, no IS, no RS."""
        return cls(rollout_is=None, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: float | str = "0.999_1.001") -> RolloutCorrectionConfig:
        """Bypass, PPO clip plus geometric rejection."""
        return cls(
            rollout_is=None,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="ppo_clip",
        )

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
        """Bypass, PPO clip plus sequence-mean k3 rejection."""
        return cls(
            rollout_is=None,
            rollout_rs="seq_mean_k3",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="ppo_clip",
        )

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Bypass, REINFORCE with sequence TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> RolloutCorrectionConfig:
        """Bypass, REINFORCE with token IcePop."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=f"{threshold_lower}_{threshold}",
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: float | str = "0.999_1.001") -> RolloutCorrectionConfig:
        """Bypass, REINFORCE with geometric rejection only."""
        return cls(
            rollout_is=None,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float | str = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Bypass, REINFORCE with geometric rejection and sequence TIS."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def bypass_pg_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float | str = "0.999_1.001"
    ) -> RolloutCorrectionConfig:
        """Bypass, REINFORCE with geometric rejection and token TIS."""
        return cls(
            rollout_is="token",
            rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=rs_threshold,
            bypass_mode=True,
            loss_type="reinforce",
        )

    @classmethod
    def disabled(cls) -> RolloutCorrectionConfig:
        """No IS, no RS, decoupled (only the off-policy diagnostics are logged)."""
        return cls(rollout_is=None, rollout_rs=None, bypass_mode=False)

    @property
    def is_enabled(self) -> bool:
        """True if IS or RS is configured."""
        return self.rollout_is is not None or bool(self.rollout_rs)


def apply_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig | Mapping[str, Any] | None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Driver-side rollout correction for one training batch: ``(weights | None, response_mask, metrics)``.

    Decoupled mode: IS/RS computed once against the recomputed π_old (the caller stores the mask as the new
    ``response_mask`` *before* computing advantages, and passes the weights to the policy loss).
    Bypass mode: the caller sets ``old_log_probs := rollout_log_probs`` and the bypass policy loss recomputes
    IS/RS per micro-batch against the current π_θ; here only the off-policy diagnostics are returned, with no
    weights and the mask unchanged. ``cfg=None`` means :meth:`RolloutCorrectionConfig.disabled`.
    """
    if not isinstance(cfg, RolloutCorrectionConfig):
        cfg = RolloutCorrectionConfig.from_dict(cfg)
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
