"""Advantage estimators (docs/REFERENCE.md §3).

Every estimator has the signature
`fn(token_level_rewards, response_mask, index=None, **kwargs) -> (advantages, returns)`, all (B, L),
computed without gradients and in the dtype of `token_level_rewards` (float32 or float64). Unknown
keyword arguments are ignored, so a dispatcher can pass one common set (`gamma`, `lam`, `values`,
`epsilon`, `norm_adv_by_std_in_grpo`, `reward_baselines`, `config`, ...); a `config` object or mapping is
read for `gamma`, `lam` and `norm_adv_by_std_in_grpo` where the explicit keyword is absent.

The outcome score of trajectory i is `r_i = Σ_t token_level_rewards[i, t]`; `index` holds one group label
per trajectory (the `uid` strings, or ints). Loop versions (`grpo`, `rloo`, ...) loop over groups in Python;
`grpo_vectorized` and `rloo_vectorized` use tensor scatter operations after factorising the labels
(hash-based, pyarrow, for strings) and compute group statistics in the input dtype (the reference: float32).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum, StrEnum
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from dapo_core.masked import masked_whiten

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AdvantageEstimator",
    "compute_advantage",
    "factorize_index",
    "get_adv_estimator",
    "group_mean_std",
    "register_adv_estimator",
]

GRPO_EPSILON = 1e-6
"""Default epsilon added to the group std (outside the sqrt)."""


class AdvantageEstimator(StrEnum):
    """Names of the built-in estimators (`algorithm.adv_estimator`); members compare equal to their value."""

    GAE = "gae"
    GRPO = "grpo"
    GRPO_VECTORIZED = "grpo_vectorized"
    RLOO = "rloo"
    RLOO_VECTORIZED = "rloo_vectorized"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    OPO = "opo"
    GPG = "gpg"
    GRPO_PASSK = "grpo_passk"


AdvFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATOR_REGISTRY: dict[str, AdvFn] = {}
"""Estimator name → function."""


def _name(name: str | Enum) -> str:
    """The registry key for a name or an Enum member."""
    return name.value if isinstance(name, Enum) else name


def register_adv_estimator(name: str | Enum) -> Callable[[AdvFn], AdvFn]:
    """Decorator registering an estimator under `name` (str or Enum).

    Registering the same function again is allowed; a different function under a taken name raises
    ValueError.
    """
    key = _name(name)

    def decorator(fn: AdvFn) -> AdvFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"Advantage estimator {key!r} is already registered to {existing.__qualname__}; "
                "choose another name for the new estimator"
            )
        ADV_ESTIMATOR_REGISTRY[key] = fn
        return fn

    return decorator


def get_adv_estimator(name: str | Enum) -> AdvFn:
    """Return the estimator registered as `name` (case sensitive); ValueError if unknown."""
    key = _name(name)
    if key not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"Unknown advantage estimator {key!r} (algorithm.adv_estimator); "
            f"registered: {sorted(ADV_ESTIMATOR_REGISTRY)}"
        )
    return ADV_ESTIMATOR_REGISTRY[key]


def compute_advantage(
    name: str | Enum,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | np.ndarray | torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the estimator `name`; extra keyword arguments go to it (unknown ones are ignored)."""
    return get_adv_estimator(name)(token_level_rewards, response_mask, index=index, **kwargs)


# --------------------------------------------------------------------------------------------------
# helpers


def _opt(kwargs: Mapping[str, Any], key: str, default: Any) -> Any:
    """Read `key` from the keyword arguments, then from `kwargs["config"]`, else `default`."""
    if kwargs.get(key) is not None:
        return kwargs[key]
    config = kwargs.get("config")
    if config is not None:
        value = config.get(key, None) if hasattr(config, "get") else getattr(config, key, None)
        if value is not None:
            return value
    return default


def _check(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any, need_index: bool
) -> None:
    """Validate shapes and the presence/length of `index`."""
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be (B, L)"
        )
    if need_index:
        if index is None:
            raise ValueError(
                "this advantage estimator groups trajectories: pass index= (one uid per trajectory)"
            )
        if len(index) != token_level_rewards.shape[0]:
            raise ValueError(
                f"index has {len(index)} labels but token_level_rewards has {token_level_rewards.shape[0]} "
                "rows; pass one uid per trajectory"
            )


def _labels(index: Sequence[Any] | np.ndarray | torch.Tensor) -> list[Any]:
    """Index labels as a list of hashable Python values."""
    if isinstance(index, (pa.Array, pa.ChunkedArray)):
        return index.to_pylist()
    if isinstance(index, (torch.Tensor, np.ndarray)):
        return index.tolist()
    return list(index)


def _groups(index: Sequence[Any] | np.ndarray | torch.Tensor) -> dict[Any, list[int]]:
    """Label → row positions, in first-seen order (used by the loop estimators)."""
    groups: dict[Any, list[int]] = {}
    for row, label in enumerate(_labels(index)):
        groups.setdefault(label, []).append(row)
    return groups


def factorize_index(
    index: Sequence[Any] | np.ndarray | torch.Tensor | pa.Array | pa.ChunkedArray,
) -> tuple[torch.Tensor, int]:
    """Map group labels to dense int64 ids `0..G-1` without a Python loop; returns `(ids, G)`.

    Integer labels are factorised with `np.unique(return_inverse=True)`; strings (and other labels)
    with pyarrow's hash-based dictionary encoding. An Arrow array (e.g. the batch's `uid` column) is
    encoded without converting it to Python objects. Null labels are rejected.
    """
    if isinstance(index, torch.Tensor):
        index = index.cpu().numpy()
    if isinstance(index, np.ndarray) and index.dtype.kind in "iub":
        uniq, inverse = np.unique(index, return_inverse=True)
        return torch.from_numpy(inverse.astype(np.int64).reshape(-1)), int(uniq.size)
    if isinstance(index, pa.ChunkedArray):
        arr = index.combine_chunks()
    elif isinstance(index, pa.Array):
        arr = index
    else:
        arr = pa.array(index.tolist() if isinstance(index, np.ndarray) else list(index))
    if arr.null_count:
        raise ValueError(f"index has {arr.null_count} null labels; every trajectory needs a uid")
    if pa.types.is_integer(arr.type):
        return factorize_index(arr.to_numpy())
    encoded = pc.dictionary_encode(arr)
    ids = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return torch.from_numpy(ids), len(encoded.dictionary)


def group_mean_std(
    scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int, eps: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group mean, unbiased std and size by scatter-add; returns per-row `(mean, std, count)`.

    Variance uses the denominator `max(n − 1, 1)` and `std = sqrt(clamp(var, min=eps))`; singleton
    groups get mean 0 and std 1 (as the loop GRPO does).
    """
    dtype = scores.dtype
    counts = torch.zeros(num_groups, dtype=dtype).index_add_(0, group_ids, torch.ones_like(scores))
    sums = torch.zeros(num_groups, dtype=dtype).index_add_(0, group_ids, scores)
    means = sums / counts.clamp(min=1)
    centered = scores - means[group_ids]
    sq = torch.zeros(num_groups, dtype=dtype).index_add_(0, group_ids, centered * centered)
    var = sq / (counts - 1).clamp(min=1)
    std = torch.sqrt(torch.clamp(var, min=eps))
    single = counts <= 1
    means = torch.where(single, torch.zeros_like(means), means)
    std = torch.where(single, torch.ones_like(std), std)
    return means[group_ids], std[group_ids], counts[group_ids]


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) → (B, L) times the mask, in the dtype of `per_row`."""
    return per_row.unsqueeze(-1) * response_mask.to(per_row.dtype)


# --------------------------------------------------------------------------------------------------
# group-relative outcome estimators


@register_adv_estimator(AdvantageEstimator.GRPO)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: `a_i = (r_i − μ_g)/(σ_g + ε)` per group (σ unbiased), or `r_i − μ_g` without std scaling.

    kwargs: `epsilon` (1e-6), `norm_adv_by_std_in_grpo` (True; False = Dr.GRPO). A singleton group has
    μ = 0, σ = 1, so `a = r/(1 + ε)`; an all-equal group gets 0. Returns `(a·mask, a·mask)`.
    """
    _check(token_level_rewards, response_mask, index, need_index=True)
    epsilon = float(_opt(kwargs, "epsilon", GRPO_EPSILON))
    norm = bool(_opt(kwargs, "norm_adv_by_std_in_grpo", True))
    scores = token_level_rewards.sum(dim=-1)
    out = scores.clone()
    for rows in _groups(index).values():
        idx = torch.as_tensor(rows)
        group = scores[idx]
        if len(rows) == 1:
            mean, std = torch.zeros((), dtype=scores.dtype), torch.ones((), dtype=scores.dtype)
        else:
            mean, std = group.mean(), group.std()
        out[idx] = (group - mean) / (std + epsilon) if norm else group - mean
    adv = _broadcast(out, response_mask)
    return adv, adv


@register_adv_estimator(AdvantageEstimator.GRPO_VECTORIZED)
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO computed with scatter-adds over factorised labels (same result as `grpo`, no group loop)."""
    _check(token_level_rewards, response_mask, index, need_index=True)
    epsilon = float(_opt(kwargs, "epsilon", GRPO_EPSILON))
    norm = bool(_opt(kwargs, "norm_adv_by_std_in_grpo", True))
    scores = token_level_rewards.sum(dim=-1)
    gids, num_groups = factorize_index(index)
    mean, std, _ = group_mean_std(scores, gids.to(scores.device), num_groups, eps=0.0)
    a = (scores - mean) / (std + epsilon) if norm else scores - mean
    adv = _broadcast(a, response_mask)
    return adv, adv


@register_adv_estimator(AdvantageEstimator.RLOO)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: `a_i = r_i − mean of the other samples of the group`; a singleton keeps `a = r`."""
    _check(token_level_rewards, response_mask, index, need_index=True)
    scores = token_level_rewards.sum(dim=-1)
    out = scores.clone()
    for rows in _groups(index).values():
        n = len(rows)
        if n > 1:
            idx = torch.as_tensor(rows)
            group = scores[idx]
            out[idx] = group * n / (n - 1) - group.mean() * n / (n - 1)
    adv = _broadcast(out, response_mask)
    return adv, adv


@register_adv_estimator(AdvantageEstimator.RLOO_VECTORIZED)
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO by scatter-add: `(c·r_i − Σ_g r)/max(c − 1, 1)·1[c > 1]`; singletons get **0** (unlike `rloo`)."""
    _check(token_level_rewards, response_mask, index, need_index=True)
    scores = token_level_rewards.sum(dim=-1)
    gids, num_groups = factorize_index(index)
    gids = gids.to(scores.device)
    counts = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, gids, torch.ones_like(scores))[gids]
    sums = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, gids, scores)[gids]
    a = (counts * scores - sums) / (counts - 1).clamp(min=1) * (counts > 1).to(scores.dtype)
    adv = _broadcast(a, response_mask)
    return adv, adv


@register_adv_estimator(AdvantageEstimator.OPO)
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: length-weighted baseline `b_g = Σ len_i·r_i / Σ len_i` (singleton b = 0); `a = r − b`."""
    _check(token_level_rewards, response_mask, index, need_index=True)
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    out = scores.clone()
    for rows in _groups(index).values():
        if len(rows) > 1:
            idx = torch.as_tensor(rows)
            baseline = (lengths[idx] * scores[idx]).sum() / lengths[idx].sum()
            out[idx] = scores[idx] - baseline
    adv = _broadcast(out, response_mask)
    return adv, adv


@register_adv_estimator(AdvantageEstimator.GPG)
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: `a_i = α·(r_i − μ_g)` with `α = B / max(#nonzero scores, 1)` (singleton μ = 0)."""
    _check(token_level_rewards, response_mask, index, need_index=True)
    scores = token_level_rewards.sum(dim=-1)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores).item()), 1)
    f_norm = 1.0
    out = scores.clone()
    for rows in _groups(index).values():
        idx = torch.as_tensor(rows)
        mean = scores[idx].mean() if len(rows) > 1 else torch.zeros((), dtype=scores.dtype)
        out[idx] = alpha * (scores[idx] - mean) / f_norm
    adv = _broadcast(out, response_mask)
    return adv, adv


@register_adv_estimator(AdvantageEstimator.GRPO_PASSK)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: only the best sample of each group gets `r_max − r_second` (÷(σ + ε) if normalising).

    Every group needs at least 2 samples (ValueError otherwise). kwargs: `epsilon`, `norm_adv_by_std_in_grpo`.
    """
    _check(token_level_rewards, response_mask, index, need_index=True)
    epsilon = float(_opt(kwargs, "epsilon", GRPO_EPSILON))
    norm = bool(_opt(kwargs, "norm_adv_by_std_in_grpo", True))
    scores = token_level_rewards.sum(dim=-1)
    out = torch.zeros_like(scores)
    for label, rows in _groups(index).items():
        if len(rows) < 2:
            raise ValueError(
                f"grpo_passk needs at least 2 samples per group; group {label!r} has {len(rows)} "
                "(set actor_rollout_ref.rollout.n >= 2)"
            )
        group = scores[torch.as_tensor(rows)]
        top, top_idx = torch.topk(group, 2)
        advantage = top[0] - top[1]
        if norm:
            advantage = advantage / (group.std() + epsilon)
        out[rows[int(top_idx[0])]] = advantage
    adv = _broadcast(out, response_mask)
    return adv, adv


@register_adv_estimator(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with group baseline: `r_i − μ_g` broadcast, then whitened over the whole batch.

    Returns `(masked_whiten(a·mask, mask)·mask,)*2`; needs at least two valid tokens in the batch.
    """
    _check(token_level_rewards, response_mask, index, need_index=True)
    scores = token_level_rewards.sum(dim=-1)
    out = scores.clone()
    for rows in _groups(index).values():
        if len(rows) > 1:
            idx = torch.as_tensor(rows)
            out[idx] = scores[idx] - scores[idx].mean()
    mask = response_mask.to(scores.dtype)
    adv = masked_whiten(_broadcast(out, mask), mask) * mask
    return adv, adv


# --------------------------------------------------------------------------------------------------
# token-level estimators


@register_adv_estimator(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return `G_t = r_t + γ·G_{t+1}`, whitened over the batch.

    Positions with mask 0 (observation / padding) are skipped: their return is 0 and the carried
    return passes through them unchanged, so γ applies only across valid tokens. kwargs: `gamma`
    (or `config.gamma`, default 1.0). Returns `(masked_whiten(returns)·mask, returns)`.
    """
    _check(token_level_rewards, response_mask, index, need_index=False)
    gamma = float(_opt(kwargs, "gamma", 1.0))
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    carry = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        g = token_level_rewards[:, t] + gamma * carry
        returns[:, t] = g * mask[:, t]
        carry = torch.where(mask[:, t] > 0, g, carry)
    adv = masked_whiten(returns, mask) * mask
    return adv, returns


@register_adv_estimator(AdvantageEstimator.REMAX)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: `returns = reverse cumsum(r·mask)`, `adv = returns − baseline·mask`.

    kwargs: `reward_baselines` (B,) — the greedy-decoding score of each prompt (required).
    """
    _check(token_level_rewards, response_mask, index, need_index=False)
    baselines = kwargs.get("reward_baselines")
    if baselines is None:
        raise ValueError(
            "remax needs reward_baselines= (the greedy-decoding score per trajectory, shape (B,))"
        )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    baselines = torch.as_tensor(baselines, dtype=returns.dtype, device=returns.device)
    adv = returns - baselines.unsqueeze(-1) * mask
    return adv, returns


@register_adv_estimator(AdvantageEstimator.GAE)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(γ, λ): `δ_t = r_t + γ·V_next − V_t`, `A_t = δ_t + γλ·A_next`, scanned right to left.

    At positions with mask 0 both `V_next` and `A_next` are carried through unchanged, so
    observation tokens inside a response neither discount nor depend on their values.
    `returns = A + V` (unwhitened); advantages are then `masked_whiten(A, mask)` (not re-masked, as
    the reference). kwargs: `values` (B, L) required, `gamma`, `lam` (or from `config`, default 1.0).
    """
    _check(token_level_rewards, response_mask, index, need_index=False)
    values = kwargs.get("values")
    if values is None:
        raise ValueError("gae needs values= (the critic's (B, L) value estimates)")
    gamma = float(_opt(kwargs, "gamma", 1.0))
    lam = float(_opt(kwargs, "lam", 1.0))
    values = values.to(token_level_rewards.dtype)
    mask = response_mask.to(token_level_rewards.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        valid = mask[:, t] > 0
        next_value = torch.where(valid, values[:, t], next_value)
        last_gae = torch.where(valid, gae, last_gae)
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1) if reversed_adv else torch.zeros_like(values)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask)
    return advantages, returns
