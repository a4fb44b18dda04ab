"""The registered policy losses other than `vanilla` (docs/REFERENCE.md §1.3): gspo, sapo, gpg, clip_cov,
kl_cov, geo_mean, dppo_tv, dppo_kl, cispo, dro, reinforce and bypass_mode.

Each loss has the shared signature described in `dapo_core.algo.losses.core` and registers itself by name with
`register_policy_loss` on import. `dapo_core.algo.losses.core` imports this module at its end, so every loss
is in `POLICY_LOSS_REGISTRY` whenever `dapo_core.algo.losses.core` is imported; use `get_policy_loss(name)`
rather than importing from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dapo_core.algo.losses.core import (
    _SEQ_TOKEN_MEAN_EPS,
    PolicyLossParams,
    _apply_is_weights,
    _clamped_log_ratio,
    _global,
    _metric,
    _resolve_params,
    agg_loss,
    compute_policy_loss_vanilla,
    register_policy_loss,
)
from dapo_core.masked import masked_mean, masked_sum

# --------------------------------------------------------------------------------------------------
# Other registered policy losses (§ 1.3)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: PPO clip on the sequence ratio `exp(mean_t log r)`, token straight-through gradient.

    `log s_it = log π_θ − sg(log π_θ) + sg(mean_t log r)`, clamped above at 10; no dual clip. The
    aggregation is forced to `seq-mean-token-mean` whatever `loss_agg_mode` says.
    """
    p = _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO: soft gate `f(r) = sigmoid(τ(r − 1))·4/τ` instead of a hard clip; loss `−f(r)·A`.

    τ = `tau_pos` where A > 0 else `tau_neg`. Aggregation forced to `seq-mean-token-mean`.
    """
    p = _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG: plain policy gradient `−log π_θ · A` (old log-probs unused); no metrics."""
    _resolve_params(params)
    pg_losses = _apply_is_weights(-log_prob * advantages, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info)), {}


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: PPO clip (no dual clip) plus dropping the loss of a few high-covariance tokens.

    Among valid tokens not already clipped, those with `cov = (A − mean A)(log π − mean log π)` in
    (`clip_cov_lb`, `clip_cov_ub`) are candidates; `max(int(clip_cov_ratio·N_valid), 1)` of them are
    chosen uniformly at random (torch global RNG) and their loss is zeroed.
    """
    p = _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: unclipped `−A·r`, plus `ppo_kl_coef·|log r|` on the top-k tokens by covariance.

    k = `max(1, int(N_valid·kl_cov_ratio))`; metric `actor/ppo_kl` is the masked mean of |log r|.
    """
    p = _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO: geometric-mean sequence ratio with token log-ratios clipped to [−ε_low, ε_high].

    The clip acts in the sign(A) direction (pessimistic); sequence ratio = exp(masked mean of the
    clipped log ratio), sequence advantage = masked mean of A, loss = plain mean over rows of
    `−Â·ratio`. Ignores `loss_agg_mode` and global info (as the reference). IS weights enter as the
    per-sequence geometric mean.
    """
    p = _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    p: PolicyLossParams,
    valid: torch.Tensor,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    global_batch_info: Mapping[str, Any] | None,
) -> tuple[torch.Tensor, dict[str, float]]:
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO (total variation): keep a token's gradient only while the probability moved little.

    With p = exp(log π): A > 0 keeps the token if `p − p_old ≤ ε_high`, otherwise if `p − p_old ≥ −ε_low`.
    Loss `−A·sg(min(r, c))·log π·valid`; `actor/pg_clipfrac` = fraction of tokens made invalid.
    """
    p = _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO (binary KL): as `dppo_tv` but the trust region is the KL of the Bernoulli(p) token event.

    `D = p_old·(log p_old − log p) + (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8))`; A > 0 keeps the
    token if `D ≤ ε_high` or `p ≤ p_old`, otherwise if `D ≤ ε_low` or `p ≥ p_old`. (Which ε goes with
    which sign is our reading of the reference, which only says "≤ ε".)
    """
    p = _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: `−sg(clamp(r, 1 − ε_low, 1 + ε_high))·A·log π` — clip the IS weight, never the gradient."""
    p = _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO: `−(log π·A − ½·β·(log π − log π_old)²)` with β = `dro_beta` > 0."""
    p = _resolve_params(params)
    if p.dro_beta is None or not p.dro_beta > 0:
        raise ValueError(
            f"loss_mode 'dro' needs actor.policy_loss.dro_beta > 0 (got {p.dro_beta}); set "
            "PolicyLossParams.dro_beta"
        )
    delta = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * p.dro_beta * delta.square())
    pg_losses = _apply_is_weights(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_global(global_batch_info))
    return loss, {"actor/ppo_kl": _metric(masked_mean(-delta, response_mask))}


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with (optional) IS weights: `−w·A·log π_θ`, no clipping.

    `old_log_prob` here is log π_rollout; metric `actor/ppo_kl = masked_mean(log π_rollout − log π_θ)`.
    Registered as `reinforce` (verl has the function but does not register it); its default
    `loss_agg_mode` is `token-mean` like every registered loss (verl's default is `seq-mean-token-sum`).
    """
    _resolve_params(params)
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
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    params: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass mode (§ 5.5): π_old is π_rollout; IS/RS are recomputed here from π_θ vs π_rollout.

    Under no_grad, `compute_rollout_correction_and_rejection_mask(log π_θ, log π_rollout, mask, ...)`
    gives IS weights and a rejection mask; then `loss_type="ppo_clip"` runs `vanilla` with ratio
    π_θ/π_rollout on the rejection mask and **no** IS weights, `loss_type="reinforce"` runs `reinforce`
    with the IS weights. Incoming `rollout_is_weights` are ignored (they would double count).
    Metrics = loss metrics + the `rollout_corr/*` metrics.
    """
    from dapo_core.algo.rollout_correction import compute_rollout_correction_and_rejection_mask

    p = _resolve_params(params)
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
