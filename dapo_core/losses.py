"""Policy losses, loss aggregation and the value loss (reference §§ 1, 2).

The DAPO objective is the clipped-surrogate `vanilla` loss with decoupled clip ranges
(`clip_ratio_low` = ε_low, `clip_ratio_high` = ε_high), dual clip for negative advantages, and
`token-mean` aggregation over the *global* mini-batch:

    ratio   = exp(clamp(log π_θ − log π_old, ±20))
    L_clip  = max(−A·ratio, −A·clamp(ratio, 1 − ε_low, 1 + ε_high))
    L       = min(−A·c, L_clip) if A < 0 else L_clip

Aggregation (`agg_loss`) follows the NEWEST global normalisation: every micro-batch loss is already
divided by the *global* token / trajectory count and multiplied by `dp_size`, so summing micro-batch
losses (no ÷ grad-accumulation) and averaging gradients over data-parallel ranks gives the gradient of
the mean over the whole mini-batch. We deliberately follow NEWEST, not the REPRO per-micro-batch mean.

Every policy loss is registered by name (`register_policy_loss`) with one signature:
`fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params, rollout_is_weights,
global_batch_info) -> (loss, metrics)`; tensors are (B, L), `loss` is a 0-dim tensor and `metrics`
maps `actor/...` keys to Python floats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dapo_core.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "PolicyLossParams",
    "actor_objective",
    "agg_loss",
    "compute_entropy_from_logits",
    "compute_policy_loss",
    "compute_value_loss",
    "get_policy_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_policy_loss",
]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""The loss aggregation modes `agg_loss` accepts."""

_LOG_RATIO_BOUND = 20.0
_SEQ_TOKEN_MEAN_EPS = 1e-8

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}
"""Loss mode name → policy loss function (see the module docstring for the shared signature)."""


# --------------------------------------------------------------------------------------------------
# Parameters and registry


@dataclass
class PolicyLossParams:
    """Hyper-parameters read by the registered policy losses (`actor.*` and `actor.policy_loss.*`)."""

    clip_ratio: float = 0.2
    """ε: symmetric clip range, used where `clip_ratio_low` / `clip_ratio_high` are None."""
    clip_ratio_low: float | None = 0.2
    """ε_low: ratio lower clip is `1 − ε_low` (DAPO: 0.2)."""
    clip_ratio_high: float | None = 0.2
    """ε_high: ratio upper clip is `1 + ε_high` (DAPO clip-higher: 0.28)."""
    clip_ratio_c: float = 3.0
    """c: dual-clip bound for negative advantages, must be > 1 (DAPO scripts: 10.0)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of valid tokens whose loss is dropped."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower covariance bound of the candidate tokens."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper covariance bound of the candidate tokens."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of valid tokens (top covariance) that get the |log ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the |log ratio| penalty."""
    dro_beta: float | None = None
    """dro: weight of the ½·(log π_θ − log π_old)² regulariser; must be > 0."""
    tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """sapo: gate temperature for non-positive advantages."""
    rollout_correction: dict[str, Any] | None = None
    """bypass_mode: the `algorithm.rollout_correction` settings (rollout_is, thresholds, rollout_rs, loss_type)."""
    rollout_log_probs: torch.Tensor | None = field(default=None, repr=False)
    """bypass_mode: log π_rollout (B, L); when None the `old_log_prob` argument is taken as π_rollout."""

    @property
    def eps_low(self) -> float:
        """Effective ε_low (`clip_ratio_low`, falling back to `clip_ratio`)."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def eps_high(self) -> float:
        """Effective ε_high (`clip_ratio_high`, falling back to `clip_ratio`)."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` (a later registration replaces an earlier one)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """Return the policy loss registered as `name`; ValueError listing the supported modes otherwise."""
    try:
        return POLICY_LOSS_REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"Unsupported loss mode: {name!r} (actor.policy_loss.loss_mode). "
            f"Supported modes are: {sorted(POLICY_LOSS_REGISTRY)}"
        ) from None


def _resolve_params(params: PolicyLossParams | None, cfg: PolicyLossParams | None) -> PolicyLossParams:
    """Accept the parameters as `params=` (brief) or `cfg=` (INTERFACES.md); default when neither."""
    if params is not None and cfg is not None and params is not cfg:
        raise ValueError("pass the policy-loss parameters once, as params= (cfg= is an alias), not both")
    chosen = params if params is not None else cfg
    return PolicyLossParams() if chosen is None else chosen


def _global(global_batch_info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The agg_loss keyword arguments carried by `global_batch_info` (unknown keys are an error)."""
    info = dict(global_batch_info or {})
    unknown = set(info) - {"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"}
    if unknown:
        raise ValueError(
            f"global_batch_info has unknown keys {sorted(unknown)}; allowed: dp_size, batch_num_tokens, "
            "global_batch_size, loss_scale_factor"
        )
    return info


def _metric(x: torch.Tensor | float) -> float:
    """A detached Python float for the metrics dict."""
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)


def _apply_is_weights(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Multiply per-token losses by the (detached) rollout IS weights, if any."""
    if rollout_is_weights is None:
        return pg_losses
    if rollout_is_weights.shape != pg_losses.shape:
        raise ValueError(
            f"rollout_is_weights shape {tuple(rollout_is_weights.shape)} != loss shape {tuple(pg_losses.shape)}; "
            "pass the (B, L) per-token weights from rollout correction"
        )
    return pg_losses * rollout_is_weights.detach().to(pg_losses.dtype)


def _clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """`log π_θ − log π_old` clamped to ±20 (NEWEST; keeps exp() finite)."""
    return torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)


# --------------------------------------------------------------------------------------------------
# Aggregation


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, L) per-token loss into a scalar, normalised by the global mini-batch.

    With `tok = masked_sum(loss_mat, loss_mask)`, `s_i` / `n_i` the per-row masked sum / token count and
    `valid_i = 1[n_i > 0]`:

    - `token-mean`: `tok / batch_num_tokens · dp_size`;
    - `token-sum`: `tok · dp_size`;
    - `seq-mean-token-sum`: `Σ valid_i·s_i / global_batch_size · dp_size`;
    - `seq-mean-token-mean`: `Σ valid_i·s_i/(n_i + 1e-8) / global_batch_size · dp_size`;
    - `seq-mean-token-sum-norm`: the `seq-mean-token-sum` value `/ loss_scale_factor`.

    `batch_num_tokens` (all valid tokens of the mini-batch over all DP ranks) and `global_batch_size`
    (trajectories of the mini-batch over all DP ranks, empty rows included) default to this call's
    own counts, which is only allowed with `dp_size == 1`. Note the token-mean fallback has no
    epsilon: an all-masked input gives NaN (0/0), as in the reference. `loss_scale_factor` defaults to
    the padded length `L`.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode!r}; use one of {LOSS_AGG_MODES}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mat shape {tuple(loss_mat.shape)} != loss_mask shape {tuple(loss_mask.shape)}; "
            "both must be (B, L)"
        )
    if int(dp_size) < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    mask = loss_mask.to(dtype=loss_mat.dtype, device=loss_mat.device)

    if loss_agg_mode == "token-mean":
        tok = masked_sum(loss_mat, mask)
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError(
                    "agg_loss(token-mean) with dp_size > 1 needs batch_num_tokens (the valid-token count of "
                    "the whole mini-batch over all DP ranks); pass it via global_batch_info"
                )
            batch_num_tokens = mask.sum()
        return tok / batch_num_tokens * dp_size

    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size

    seq_sums = masked_sum(loss_mat, mask, axis=-1)
    seq_counts = mask.sum(dim=-1)
    seq_valid = (seq_counts > 0).to(loss_mat.dtype)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_sums / (seq_counts + _SEQ_TOKEN_MEAN_EPS)
    else:
        seq_losses = seq_sums
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(
                f"agg_loss({loss_agg_mode}) with dp_size > 1 needs global_batch_size (trajectories in the "
                "whole mini-batch over all DP ranks); pass it via global_batch_info"
            )
        global_batch_size = seq_valid.sum()
    loss = masked_sum(seq_losses, seq_valid) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = loss / loss_scale_factor
    return loss


# --------------------------------------------------------------------------------------------------
# Vanilla (PPO / DAPO) policy loss


def _vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    global_batch_info: Mapping[str, Any] | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate with dual clip, in the reference order of operations (§ 1.2)."""
    if not clip_ratio_c > 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1.0 (it is the dual-clip lower bound -A·c for A < 0), got {clip_ratio_c}; "
            "set actor.clip_ratio_c (DAPO uses 10.0)"
        )
    neg_kl = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(log_prob.dtype), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(
        ((clip_pg_losses1 > pg_losses3) & negative).to(log_prob.dtype), response_mask
    )

    pg_losses = torch.where(negative, clip_pg_losses2, clip_pg_losses1)
    pg_losses = _apply_is_weights(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info))
    metrics = {
        "actor/pg_clipfrac": _metric(pg_clipfrac),
        "actor/ppo_kl": _metric(ppo_kl),
        "actor/pg_clipfrac_lower": _metric(pg_clipfrac_lower),
    }
    return loss, metrics


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The `vanilla` (PPO / DAPO) policy loss with keyword hyper-parameters.

    Returns `(loss, metrics)`; metrics are Python floats `pg_clipfrac` (fraction of tokens where the clipped
    term is strictly larger), `ppo_kl` (masked mean of `log π_old − log π_θ`, after the ±20 clamp) and
    `pg_clipfrac_lower` (dual-clip hits among A < 0). The registered losses (`get_policy_loss("vanilla")`)
    return the same values under verl's logged names `actor/pg_clipfrac`, … . Unlike the deprecated verl
    `compute_policy_loss` this does not return a 4-tuple and does take global batch info.
    """
    loss, metrics = _vanilla(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        eps_low=clip_ratio_low,
        eps_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_batch_info=global_batch_info,
    )
    return loss, {k.removeprefix("actor/"): v for k, v in metrics.items()}


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
    cfg: PolicyLossParams | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with decoupled clip (ε_low, ε_high) and dual clip c for A < 0 (DAPO)."""
    p = _resolve_params(params, cfg)
    return _vanilla(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        eps_low=p.eps_low,
        eps_high=p.eps_high,
        clip_ratio_c=p.clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        global_batch_info=global_batch_info,
    )


# --------------------------------------------------------------------------------------------------
# Other registered policy losses (§ 1.3)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """GSPO: PPO clip on the sequence ratio `exp(mean_t log r)`, token straight-through gradient.

    `log s_it = log π_θ − sg(log π_θ) + sg(mean_t log r)`, clamped above at 10; no dual clip. The
    aggregation is forced to `seq-mean-token-mean` whatever `loss_agg_mode` says.
    """
    p = _resolve_params(params, cfg)
    neg_kl = log_prob - old_log_prob
    seq_len = response_mask.to(log_prob.dtype).sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(neg_kl, response_mask, axis=-1) / seq_len
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1.0 - p.eps_low, 1.0 + p.eps_high)
    pg_losses = _apply_is_weights(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **_global(global_batch_info))
    metrics = {
        "actor/pg_clipfrac": _metric(
            masked_mean((pg_losses2 > pg_losses1).to(log_prob.dtype), response_mask)
        ),
        "actor/ppo_kl": _metric(masked_mean(-neg_kl, response_mask)),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """SAPO: soft gate `f(r) = sigmoid(τ(r − 1))·4/τ` instead of a hard clip; loss `−f(r)·A`.

    τ = `tau_pos` where A > 0 else `tau_neg`. Aggregation forced to `seq-mean-token-mean`.
    """
    p = _resolve_params(params, cfg)
    neg_kl = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_kl)
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, p.tau_pos),
        torch.full_like(ratio, p.tau_neg),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = _apply_is_weights(-gate * advantages, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **_global(global_batch_info))
    metrics = {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": _metric(masked_mean(-neg_kl, response_mask)),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """GPG: plain policy gradient `−log π_θ · A` (old log-probs unused); no metrics."""
    _resolve_params(params, cfg)
    pg_losses = _apply_is_weights(-log_prob * advantages, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info)), {}


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """Clip-Cov: PPO clip (no dual clip) plus dropping the loss of a few high-covariance tokens.

    Among valid tokens not already clipped, those with `cov = (A − mean A)(log π − mean log π)` in
    (`clip_cov_lb`, `clip_cov_ub`) are candidates; `max(int(clip_cov_ratio·N_valid), 1)` of them are
    chosen uniformly at random (torch global RNG) and their loss is zeroed.
    """
    p = _resolve_params(params, cfg)
    if not p.clip_cov_ratio > 0:
        raise ValueError(
            f"clip_cov_ratio must be > 0, got {p.clip_cov_ratio}; set actor.policy_loss.clip_cov_ratio"
        )
    neg_kl = log_prob - old_log_prob
    ratio = torch.exp(neg_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - p.eps_low, 1.0 + p.eps_high)
    valid = response_mask > 0
    with torch.no_grad():
        clipped = (pg_losses2 > pg_losses1) & valid
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob.detach() - masked_mean(log_prob.detach(), response_mask)
        )
        candidates = valid & ~clipped & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)
        cand_idx = candidates.reshape(-1).nonzero(as_tuple=True)[0]
        n_drop = max(int(p.clip_cov_ratio * int(valid.sum().item())), 1)
        keep = torch.ones(advantages.numel(), dtype=log_prob.dtype, device=log_prob.device)
        if cand_idx.numel() > 0:
            chosen = cand_idx[torch.randperm(cand_idx.numel(), device=cand_idx.device)[:n_drop]]
            keep[chosen] = 0.0
        keep = keep.reshape(advantages.shape)
    pg_losses = _apply_is_weights(torch.maximum(pg_losses1, pg_losses2) * keep, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info))
    metrics = {
        "actor/pg_clipfrac": _metric(masked_mean((keep == 0).to(log_prob.dtype), response_mask)),
        "actor/ppo_kl": _metric(masked_mean(-neg_kl, response_mask)),
    }
    return loss, metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """KL-Cov: unclipped `−A·r`, plus `ppo_kl_coef·|log r|` on the top-k tokens by covariance.

    k = `max(1, int(N_valid·kl_cov_ratio))`; metric `actor/ppo_kl` is the masked mean of |log r|.
    """
    p = _resolve_params(params, cfg)
    neg_kl = log_prob - old_log_prob
    abs_kl = neg_kl.abs()
    ratio = torch.exp(neg_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = pg_losses1 + p.ppo_kl_coef * abs_kl
    with torch.no_grad():
        flat_valid = (response_mask > 0).reshape(-1).nonzero(as_tuple=True)[0]
        penalise = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
        if flat_valid.numel() > 0 and p.kl_cov_ratio > 0:
            adv_v = advantages.detach().reshape(-1)[flat_valid]
            logp_v = log_prob.detach().reshape(-1)[flat_valid]
            cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
            k = max(1, int(flat_valid.numel() * p.kl_cov_ratio))
            top = torch.topk(cov, k, largest=True).indices
            penalise[flat_valid[top]] = True
        penalise = penalise.reshape(advantages.shape)
    pg_losses = _apply_is_weights(torch.where(penalise, pg_losses_kl, pg_losses1), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info))
    return loss, {"actor/ppo_kl": _metric(masked_mean(abs_kl, response_mask))}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """GMPO: geometric-mean sequence ratio with token log-ratios clipped to [−ε_low, ε_high].

    The clip acts in the sign(A) direction (pessimistic); sequence ratio = exp(masked mean of the
    clipped log ratio), sequence advantage = masked mean of A, loss = plain mean over rows of
    `−Â·ratio`. Ignores `loss_agg_mode` and global info (as the reference). IS weights enter as the
    per-sequence geometric mean.
    """
    p = _resolve_params(params, cfg)
    neg_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-neg_kl, response_mask)
    sign = torch.sign(advantages)
    neg_kl_clamp = torch.clamp(neg_kl, -p.eps_low, p.eps_high)
    neg_kl_min = sign * torch.minimum(sign * neg_kl, sign * neg_kl_clamp)
    mask = response_mask.to(log_prob.dtype)
    n = mask.sum(dim=-1)
    seq_ratio = torch.exp(masked_sum(neg_kl_min, mask, axis=-1) / (n + _SEQ_TOKEN_MEAN_EPS))
    seq_adv = masked_sum(advantages, mask, axis=-1) / (n + _SEQ_TOKEN_MEAN_EPS)
    pg_losses = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach().to(log_prob.dtype).clamp(min=1e-8))
        pg_losses = pg_losses * torch.exp(masked_sum(log_w, mask, axis=-1) / (n + _SEQ_TOKEN_MEAN_EPS))
    loss = pg_losses.mean()
    clipped = neg_kl != neg_kl_clamp
    metrics = {
        "actor/pg_clipfrac": _metric(masked_mean((clipped & (advantages > 0)).to(log_prob.dtype), mask)),
        "actor/ppo_kl": _metric(ppo_kl),
        "actor/pg_clipfrac_lower": _metric(
            masked_mean((clipped & (advantages < 0)).to(log_prob.dtype), mask)
        ),
    }
    return loss, metrics


def _dppo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    p,
    valid,
    loss_agg_mode,
    rollout_is_weights,
    global_batch_info,
):
    """Shared tail of the DPPO losses: `−A·sg(min(r, c))·log π·valid`."""
    neg_kl = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_kl)
    valid_f = valid.to(log_prob.dtype)
    pg_losses = -advantages * torch.clamp(ratio, max=p.clip_ratio_c).detach() * log_prob * valid_f
    pg_losses = _apply_is_weights(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info))
    metrics = {
        "actor/pg_clipfrac": _metric(masked_mean(1.0 - valid_f, response_mask)),
        "actor/ppo_kl": _metric(masked_mean(-neg_kl, response_mask)),
    }
    return loss, metrics


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """DPPO (total variation): keep a token's gradient only while the probability moved little.

    With p = exp(log π): A > 0 keeps the token if `p − p_old ≤ ε_high`, otherwise if `p − p_old ≥ −ε_low`.
    Loss `−A·sg(min(r, c))·log π·valid`; `actor/pg_clipfrac` = fraction of tokens made invalid.
    """
    p = _resolve_params(params, cfg)
    with torch.no_grad():
        dp = torch.exp(log_prob.detach()) - torch.exp(old_log_prob.detach())
        valid = torch.where(advantages > 0, dp <= p.eps_high, dp >= -p.eps_low)
    return _dppo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        p,
        valid,
        loss_agg_mode,
        rollout_is_weights,
        global_batch_info,
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """DPPO (binary KL): as `dppo_tv` but the trust region is the KL of the Bernoulli(p) token event.

    `D = p_old·(log p_old − log p) + (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8))`; A > 0 keeps the
    token if `D ≤ ε_high` or `p ≤ p_old`, otherwise if `D ≤ ε_low` or `p ≥ p_old`. (Which ε goes with
    which sign is our reading of the reference, which only says "≤ ε".)
    """
    p = _resolve_params(params, cfg)
    with torch.no_grad():
        logp, logp_old = log_prob.detach(), old_log_prob.detach()
        prob, prob_old = torch.exp(logp), torch.exp(logp_old)
        bkl = prob_old * (logp_old - logp) + (1 - prob_old) * torch.log(
            (1 - prob_old + 1e-8) / (1 - prob + 1e-8)
        )
        valid = torch.where(
            advantages > 0,
            (bkl <= p.eps_high) | (prob <= prob_old),
            (bkl <= p.eps_low) | (prob >= prob_old),
        )
    return _dppo(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        p,
        valid,
        loss_agg_mode,
        rollout_is_weights,
        global_batch_info,
    )


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """CISPO: `−sg(clamp(r, 1 − ε_low, 1 + ε_high))·A·log π` — clip the IS weight, never the gradient."""
    p = _resolve_params(params, cfg)
    neg_kl = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(neg_kl)
    clipped_ratio = torch.clamp(ratio, 1.0 - p.eps_low, 1.0 + p.eps_high)
    pg_losses = _apply_is_weights(-clipped_ratio.detach() * advantages * log_prob, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info))
    metrics = {
        "actor/pg_clipfrac": _metric(masked_mean((ratio != clipped_ratio).to(log_prob.dtype), response_mask)),
        "actor/ppo_kl": _metric(masked_mean(-neg_kl, response_mask)),
    }
    return loss, metrics


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """DRO: `−(log π·A − ½·β·(log π − log π_old)²)` with β = `dro_beta` > 0."""
    p = _resolve_params(params, cfg)
    if p.dro_beta is None or not p.dro_beta > 0:
        raise ValueError(
            f"loss_mode 'dro' needs actor.policy_loss.dro_beta > 0 (got {p.dro_beta}); set PolicyLossParams.dro_beta"
        )
    delta = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * p.dro_beta * delta.square())
    pg_losses = _apply_is_weights(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info))
    return loss, {"actor/ppo_kl": _metric(masked_mean(-delta, response_mask))}


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """REINFORCE with (optional) IS weights: `−w·A·log π_θ`, no clipping.

    `old_log_prob` here is log π_rollout; metric `actor/ppo_kl = masked_mean(log π_rollout − log π_θ)`.
    Registered as `reinforce` (verl has the function but does not register it); its default
    `loss_agg_mode` is `token-mean` like every registered loss (verl's default is `seq-mean-token-sum`).
    """
    _resolve_params(params, cfg)
    pg_losses = _apply_is_weights(-advantages * log_prob, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info))
    return loss, {"actor/ppo_kl": _metric(masked_mean(old_log_prob - log_prob, response_mask))}


def _is_weights_tensor(obj: Any) -> torch.Tensor | None:
    """Extract the IS-weight tensor from whatever rollout correction returned (tensor, mapping, DataProto)."""
    if obj is None or isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        return obj.get("rollout_is_weights")
    batch = getattr(obj, "batch", None)
    if batch is not None:
        return batch["rollout_is_weights"]
    raise TypeError(f"unexpected rollout_is_weights container {type(obj).__name__}")


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    params=None,
    rollout_is_weights=None,
    global_batch_info=None,
    cfg=None,
):
    """Bypass mode (§ 5.5): π_old is π_rollout; IS/RS are recomputed here from π_θ vs π_rollout.

    Under no_grad, `compute_rollout_correction_and_rejection_mask(log π_θ, log π_rollout, mask, ...)`
    gives IS weights and a rejection mask; then `loss_type="ppo_clip"` runs `vanilla` with ratio
    π_θ/π_rollout on the rejection mask and **no** IS weights, `loss_type="reinforce"` runs `reinforce`
    with the IS weights. Incoming `rollout_is_weights` are ignored (they would double count).
    Metrics = loss metrics + the `rollout_corr/*` metrics.
    """
    from dapo_core.rollout_correction import compute_rollout_correction_and_rejection_mask

    p = _resolve_params(params, cfg)
    rc = dict(p.rollout_correction or {})
    loss_type = rc.get("loss_type", "ppo_clip") or "ppo_clip"
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(
            f"algorithm.rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', got {loss_type!r}"
        )
    rollout_log_prob = old_log_prob if p.rollout_log_probs is None else p.rollout_log_probs
    with torch.no_grad():
        is_out, rs_mask, rc_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob.detach(),
            rollout_log_prob=rollout_log_prob.detach(),
            response_mask=response_mask,
            rollout_is=rc.get("rollout_is"),
            rollout_is_threshold=rc.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=rc.get("rollout_is_batch_normalize", False),
            rollout_rs=rc.get("rollout_rs"),
            rollout_rs_threshold=rc.get("rollout_rs_threshold"),
        )
    is_weights = _is_weights_tensor(is_out)
    if loss_type == "reinforce":
        loss, metrics = compute_policy_loss_reinforce(
            rollout_log_prob,
            log_prob,
            advantages,
            rs_mask,
            loss_agg_mode=loss_agg_mode,
            params=p,
            rollout_is_weights=is_weights,
            global_batch_info=global_batch_info,
        )
    else:
        loss, metrics = compute_policy_loss_vanilla(
            rollout_log_prob,
            log_prob,
            advantages,
            rs_mask,
            loss_agg_mode=loss_agg_mode,
            params=p,
            rollout_is_weights=None,
            global_batch_info=global_batch_info,
        )
    merged = {k: _metric(v) for k, v in dict(rc_metrics).items()}
    merged.update(metrics)
    return loss, merged


# --------------------------------------------------------------------------------------------------
# Value loss, entropy, full actor objective


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (note the argument order: vpreds, returns, values).

    `vclip = clamp(vpreds, values − c, values + c)`;
    `vf_loss = ½·agg_loss(max((vpreds − R)², (vclip − R)²))` with the global info;
    `vf_clipfrac = masked_mean((vclip − R)² > (vpreds − R)²)` (a detached 0-dim tensor).
    """
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpredclipped - returns).square()
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(
        clipped_vf_losses,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).to(vpreds.dtype), response_mask).detach()
    return vf_loss, vf_clipfrac


def compute_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the softmax over the last axis: `logsumexp(z) − Σ softmax(z)·z`."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(dim=-1)


def actor_objective(
    pg_loss: torch.Tensor,
    entropy: torch.Tensor | None,
    kl: torch.Tensor | None,
    *,
    response_mask: torch.Tensor,
    entropy_coeff: float = 0.0,
    kl_loss_coef: float = 0.0,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Full actor loss `pg_loss − entropy_coeff·agg(entropy) + kl_loss_coef·agg(kl)` (§ 1.4).

    `entropy` and `kl` are per-token (B, L) tensors (`kl` from `dapo_core.kl.kl_penalty(log_prob,
    ref_log_prob, actor.kl_loss_type)`), or None when the term is off; both are aggregated with the
    same mode and global info as the pg loss. Returns the loss and metrics `actor/pg_loss`, plus
    `actor/entropy_loss` (when entropy is given) and `actor/kl_loss`, `actor/kl_coef` (when kl is given).
    DAPO: entropy_coeff = 0 and no KL loss, so the objective is the pg loss.
    """
    info = _global(global_batch_info)
    loss = pg_loss
    metrics = {"actor/pg_loss": _metric(pg_loss)}
    if entropy is not None:
        entropy_loss = agg_loss(entropy, response_mask, loss_agg_mode, **info)
        metrics["actor/entropy_loss"] = _metric(entropy_loss)
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * entropy_loss
    if kl is not None:
        kl_loss = agg_loss(kl, response_mask, loss_agg_mode, **info)
        metrics["actor/kl_loss"] = _metric(kl_loss)
        metrics["actor/kl_coef"] = float(kl_loss_coef)
        loss = loss + kl_loss_coef * kl_loss
    return loss, metrics
