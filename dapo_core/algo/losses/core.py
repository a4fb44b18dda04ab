"""Policy losses, loss aggregation and the value loss (docs/REFERENCE.md §§1, 2).

The DAPO objective is the clipped-surrogate `vanilla` loss with decoupled clip ranges (`clip_ratio_low` =
ε_low, `clip_ratio_high` = ε_high), dual clip for negative advantages, and `token-mean` aggregation over the
*global* mini-batch (`agg_loss`: NEWEST's global normalisation, not REPRO's per-micro-batch mean):

    ratio   = exp(clamp(log π_θ − log π_old, ±20))
    L_clip  = max(−A·ratio, −A·clamp(ratio, 1 − ε_low, 1 + ε_high))
    L       = min(−A·c, L_clip) if A < 0 else L_clip

Every policy loss is registered by name (`register_policy_loss`) with one signature:
`fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params, rollout_is_weights,
global_batch_info) -> (loss, metrics)` on (B, L) tensors, `loss` 0-dim, `metrics` `actor/...` floats; the
others live in `dapo_core.algo.losses.variants`, imported by the package. More in
docs/ARCHITECTURE.md (Engines).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from dapo_core.algo.kl import kl_penalty
from dapo_core.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "ActorLoss",
    "LossAggMode",
    "PiOld",
    "PolicyLossParams",
    "actor_objective",
    "agg_loss",
    "compute_value_loss",
    "get_policy_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_policy_loss",
]

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
"""The loss aggregation modes `agg_loss` accepts (the config field's type)."""
LOSS_AGG_MODES: tuple[LossAggMode, ...] = get_args(LossAggMode)
"""The same modes as a tuple, in order."""

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
    """bypass_mode: the `algorithm.rollout_correction` settings (rollout_is, thresholds, rollout_rs,
    loss_type)."""
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


def _resolve_params(params: PolicyLossParams | None) -> PolicyLossParams:
    """The given parameters, or the defaults when None."""
    return PolicyLossParams() if params is None else params


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
            f"rollout_is_weights shape {tuple(rollout_is_weights.shape)} != loss shape "
            f"{tuple(pg_losses.shape)}; pass the (B, L) per-token weights from rollout correction"
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
            "clip_ratio_c must be > 1.0 (it is the dual-clip lower bound -A·c for A < 0), got "
            f"{clip_ratio_c}; set actor.clip_ratio_c (DAPO uses 10.0)"
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with decoupled clip (ε_low, ε_high) and dual clip c for A < 0 (DAPO)."""
    p = _resolve_params(params)
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
# Value loss, full actor objective


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


def actor_objective(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_mode: str = "vanilla",
    params: PolicyLossParams | None = None,
    loss_agg_mode: str = "token-mean",
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    ref_log_prob: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor loss of one micro-batch (§ 1.4), as `ActorWorker` trains it:
    `pg_loss − entropy_coeff·agg(entropy) + kl_loss_coef·agg(kl_penalty(log_prob, ref_log_prob))`.

    `pg_loss` is the registered policy loss `loss_mode` with `params`; `entropy` (B, L) is None when it was
    not computed, `ref_log_prob` (B, L) None when the KL loss is off (`actor.use_kl_loss`); the KL estimator
    is `kl_loss_type`. Every term is aggregated with `loss_agg_mode` and the same `global_batch_info`.
    Returns the loss and metrics: the policy loss's own (`actor/pg_clipfrac`, …), `actor/pg_loss` (the policy
    loss alone, as verl logs it), plus `actor/entropy_loss` (when entropy is given) and `actor/kl_loss`,
    `actor/kl_coef` (when the KL loss is on). DAPO: entropy_coeff = 0 and no KL loss, so the objective is the
    pg loss.
    """
    info = _global(global_batch_info)
    pg_loss, pg_metrics = get_policy_loss(loss_mode)(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode=loss_agg_mode,
        params=params,
        rollout_is_weights=rollout_is_weights,
        global_batch_info=info,
    )
    metrics = {k if k.startswith("actor/") else f"actor/{k}": v for k, v in pg_metrics.items()}
    metrics["actor/pg_loss"] = _metric(pg_loss)
    loss = pg_loss
    if entropy is not None:
        entropy_loss = agg_loss(entropy, response_mask, loss_agg_mode, **info)
        metrics["actor/entropy_loss"] = _metric(entropy_loss)
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * entropy_loss
    if ref_log_prob is not None:
        kl = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
        kl_loss = agg_loss(kl, response_mask, loss_agg_mode, **info)
        metrics["actor/kl_loss"] = _metric(kl_loss)
        metrics["actor/kl_coef"] = float(kl_loss_coef)
        loss = loss + kl_loss_coef * kl_loss
    return loss, metrics


PiOld = Literal["old_log_probs", "rollout_log_probs", "current"]
"""Where the update's π_old comes from: the old_log_prob stage's column; the rollout's log-probs (bypass
mode, no stage); or the update's own forward, detached (an exactly on-policy update, no stage)."""


@dataclass(frozen=True)
class ActorLoss:
    """The actor's loss of one micro-batch under fixed settings: `actor_objective` applied to a micro-batch's
    tensors, in the form the PPO loop calls (`loss(log_probs, entropy, micro_batch, global_batch_info)`).

    π_old is the micro-batch tensor `pi_old` names, or this forward's own log-probs detached (`"current"`:
    the flow decided the update is exactly on-policy, ratio 1); unless it is the old_log_prob stage's
    column, the entropy metric comes from this forward. The KL loss needs `ref_log_probs` in the
    micro-batch; `bypass_mode` reads `rollout_log_probs`."""

    loss_mode: str
    """Registered policy loss (`actor.policy_loss.loss_mode`)."""
    params: PolicyLossParams
    """Its hyper-parameters (clip ranges, dual clip, rollout correction)."""
    loss_agg_mode: str
    """Aggregation of every term (`actor.loss_agg_mode`; DAPO: token-mean)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (`actor.entropy_coeff`)."""
    use_kl_loss: bool = False
    """Add `kl_loss_coef`·KL(π‖π_ref) (`actor.use_kl_loss`)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss (`actor.kl_loss_coef`)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator (`actor.kl_loss_type`)."""
    loss_scale_factor: float | None = None
    """Constant divisor of the seq-mean-token-sum-norm mode (`actor.loss_scale_factor`; null = the length)."""
    pi_old: PiOld = "old_log_probs"
    """Where π_old comes from (the flow's decision, `flows.learn.pi_old_source`)."""

    def __call__(
        self,
        log_probs: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: Mapping[str, torch.Tensor],
        global_batch_info: Mapping[str, Any],
    ) -> tuple[torch.Tensor, dict[str, float]]:
        params = self.params
        if self.loss_mode == "bypass_mode":
            params = dataclasses.replace(params, rollout_log_probs=mb["rollout_log_probs"])
        info = dict(global_batch_info)
        if self.loss_scale_factor is not None:
            info["loss_scale_factor"] = self.loss_scale_factor
        use_kl = self.use_kl_loss and "ref_log_probs" in mb
        old = log_probs.detach() if self.pi_old == "current" else mb[self.pi_old]
        loss, metrics = actor_objective(
            old,
            log_probs,
            mb["advantages"],
            mb["response_mask"],
            loss_mode=self.loss_mode,
            params=params,
            loss_agg_mode=self.loss_agg_mode,
            entropy=entropy,
            entropy_coeff=self.entropy_coeff,
            ref_log_prob=mb["ref_log_probs"] if use_kl else None,
            kl_loss_coef=self.kl_loss_coef,
            kl_loss_type=self.kl_loss_type,
            rollout_is_weights=mb.get("rollout_is_weights"),
            global_batch_info=info,
        )
        if self.pi_old != "old_log_probs" and entropy is not None:  # the skipped stage's metric, summed
            metrics["actor/entropy"] = metrics["actor/entropy_loss"]
        return loss, metrics
