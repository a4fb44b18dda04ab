"""KL estimators, KL controllers and the KL-in-reward penalty (docs/REFERENCE.md §4).

Per-token estimators of KL(π ‖ π_ref) from `d = logprob − ref_logprob`:

| kind | value |
|---|---|
| `kl` / `k1` | `d` |
| `abs` | `|d|` |
| `mse` / `k2` | `½·d²` |
| `low_var_kl` / `k3` | `x = clamp(−d, ±20)`, `clamp(exp(x) − x − 1, ±10)` |

A trailing `+` (e.g. `k3+`) is the straight-through variant: the forward value is the base estimator, the
gradient is that of `k2` (i.e. `d`). `full` is not implemented (it needs full distributions). DAPO runs with
every KL term off; these serve PPO/GRPO configs and `actor.use_kl_loss` (`losses.core.actor_objective`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from dapo_core.masked import masked_mean

__all__ = [
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_in_reward",
    "get_kl_controller",
    "kl_penalty",
]

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""Base estimator names accepted by `kl_penalty` (each also with a `+` suffix)."""

_LOG_RATIO_BOUND = 20.0
_K3_BOUND = 10.0


def _base_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Value of one base estimator (no `+` suffix)."""
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("low_var_kl", "k3"):
        x = torch.clamp(ref_logprob - logprob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
        k3 = torch.exp(x) - x - 1
        return torch.clamp(k3, min=-_K3_BOUND, max=_K3_BOUND)
    if kind == "full":
        raise NotImplementedError(
            "kl_penalty kind 'full' needs the full vocabulary distributions and is not implemented; "
            f"use one of {KL_KINDS}"
        )
    raise NotImplementedError(
        f"Unknown kl_penalty kind {kind!r}; use one of {KL_KINDS} (optionally with '+')"
    )


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy, shape of `logprob`.

    `kind` is one of `KL_KINDS`, optionally suffixed with `+` for the straight-through variant
    `b − sg(b) + sg(f)` (`b = ½·d²`, `f` = base value): forward value `f`, gradient of `k2`.
    Raises NotImplementedError for `full` and unknown kinds.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    value = _base_kl(logprob, ref_logprob, base)
    if not straight_through or kind in ("mse", "k2"):
        return value
    d = logprob - ref_logprob
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """A constant KL coefficient β; `update` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): β moves toward keeping KL near `target_kl`.

    `update(current_kl, n_steps)`: `e = clip(current_kl / target_kl − 1, −0.2, 0.2)`,
    `β ← β · (1 + e · n_steps / horizon)`.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(
                f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β by the clipped proportional error, scaled by `n_steps / horizon`."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"


def get_kl_controller(
    type: Any = "fixed", kl_coef: float = 0.001, horizon: int = 10000, target_kl: float = 0.1
) -> FixedKLController | AdaptiveKLController:
    """Build the controller for `algorithm.kl_ctrl`.

    `type` is `"fixed"` or `"adaptive"`; it may also be the `kl_ctrl` config itself (a mapping or
    an object with `type`, `kl_coef`, `horizon`, `target_kl`), in which case the other arguments
    are read from it. Raises NotImplementedError for other types.
    """
    if not isinstance(type, str):
        cfg = type
        get: Callable[[str, Any], Any] = (
            cfg.get if isinstance(cfg, Mapping) or hasattr(cfg, "get") else (lambda k, d: getattr(cfg, k, d))
        )
        type = get("type", "fixed")
        kl_coef = get("kl_coef", kl_coef)
        horizon = get("horizon", horizon)
        target_kl = get("target_kl", target_kl)
    if type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if type == "adaptive":
        if horizon is None or horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for type 'adaptive', got {horizon}")
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise NotImplementedError(f"algorithm.kl_ctrl.type {type!r} is not supported; use 'fixed' or 'adaptive'")


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract β·KL from the token-level scores and update the controller (`use_kl_in_reward`).

    `kld = kl_penalty(old_log_probs, ref_log_probs, kind) · mask`, `rewards = scores − β·kld` with β
    the controller value *before* the update. `current_kl` is the mean over trajectories of each
    trajectory's masked-mean KL; the controller is updated with `n_steps = B`. Returns the rewards
    and the metrics `actor/reward_kl_penalty` and `actor/reward_kl_penalty_coeff`.
    """
    if token_level_scores.shape != response_mask.shape:
        raise ValueError(
            f"token_level_scores shape {tuple(token_level_scores.shape)} != response_mask shape "
            f"{tuple(response_mask.shape)}; both must be (B, L) over the response tokens"
        )
    with torch.no_grad():
        mask = response_mask.to(token_level_scores.dtype)
        kld = kl_penalty(old_log_probs, ref_log_probs, kind).to(token_level_scores.dtype)
        # masked entries are replaced by 0 *before* multiplying (reference masked_sum convention), so a NaN
        # from padded log-probs (e.g. −inf − −inf) cannot reach the rewards, whose row sums are the GRPO
        # scores
        kld = torch.where(mask != 0, kld * mask, torch.zeros((), dtype=kld.dtype))
        beta = kl_ctrl.value
        token_level_rewards = token_level_scores - beta * kld
        per_seq = masked_mean(kld, mask, axis=-1)
        current_kl = float(per_seq.mean().item()) if per_seq.numel() else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}
    return token_level_rewards, metrics
