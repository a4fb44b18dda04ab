"""Driver-side stage logic that needs no model: building generation batches, dynamic-sampling bookkeeping,
assembling the training batch, and the advantage stage (KL in reward, rollout correction, estimator).

Pure functions over Arrow tables; the Prefect tasks in `tasks/` call them and commit their outputs.
Section numbers (§N.M) refer to docs/REFERENCE.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from dapo_core.algo.advantages import compute_advantage
from dapo_core.algo.dynamic_sampling import filter_groups
from dapo_core.data import batch as B
from dapo_core.errors import DapoUserError
from dapo_core.metrics.step import compute_data_metrics


class DynamicSamplingExhausted(DapoUserError, ValueError):
    """Raised when `max_num_gen_batches` generation batches did not yield `train_batch_size` informative
    groups."""


def exhausted_message(num_gen_batches: int, max_num_gen_batches: int, kept: int, needed: int) -> str:
    """The reference's error text (§6.1 step 9), with our counts and the two ways out."""
    return (
        f"num_gen_batches={num_gen_batches} >= max_num_gen_batches={max_num_gen_batches}. Generated too "
        "many. Please check if your data are too difficult. You could also try set max_num_gen_batches=0 to "
        f"enable endless trials. (kept {kept} of the {needed} groups needed; key: "
        "algorithm.filter_groups.max_num_gen_batches)"
    )


def filter_column(metric: str) -> str:
    """The reward-stage column that holds `algorithm.filter_groups.metric` (see `filter_metric_values`)."""
    return "reward" if metric in ("seq_reward", "seq_final_reward") else metric


def filter_metric_values(table: pa.Table, metric: str) -> np.ndarray:
    """Per-trajectory values of the dynamic-sampling metric (§6.1 step 7).

    `seq_reward` = score + overlong penalty (the token-level score sum); `seq_final_reward` additionally
    includes a KL-in-reward penalty in the reference. We filter before the reference policy runs, so here
    `seq_final_reward` equals `seq_reward` (identical unless `use_kl_in_reward` is on; `validate_config` warns
    about that case). Any other name reads the reward column of that name (`acc`, `score`, ...).
    """
    col = filter_column(metric)
    if col not in table.column_names:
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r}: the reward stage produced no column {col!r}; "
            f"available: {sorted(table.column_names)}"
        )
    return np.asarray(table.column(col).to_numpy(zero_copy_only=False), dtype=np.float64)


@dataclass
class FilterOutcome:
    """What dynamic sampling kept from one generation batch."""

    kept: pa.Table
    num_groups: int
    num_kept_groups: int
    metrics: dict[str, float] = field(default_factory=dict)


def apply_group_filter(table: pa.Table, metric: str) -> FilterOutcome:
    """Keep the groups whose metric has non-zero population std (singletons kept), order preserved."""
    uids = table.column("uid").to_pylist()
    keep = filter_groups(uids, filter_metric_values(table, metric))
    kept = table.filter(pa.array(keep))
    n_groups = len(set(uids))
    n_kept = len(set(kept.column("uid").to_pylist()))
    return FilterOutcome(kept, n_groups, n_kept, {"train/filter_keep_rate": n_kept / max(n_groups, 1)})


def truncate_to_groups(table: pa.Table, num_groups: int, n: int) -> tuple[pa.Table, int]:
    """First `num_groups·n` rows (a group boundary, since every kept group has n rows); returns dropped
    groups."""
    rows = num_groups * n
    have = table.num_rows // n
    return table.slice(0, min(rows, table.num_rows)), max(have - num_groups, 0)


def truncated_rows(table: pa.Table) -> np.ndarray:
    """(B,) bool: the rows whose generation stopped at `data.max_response_length` (`finish_reason` "length"),
    the samples that overlong filtering (`actor_rollout_ref.actor.mask_truncated_responses`) leaves out of
    the loss."""
    if "finish_reason" not in table.column_names:
        raise KeyError(
            "actor_rollout_ref.actor.mask_truncated_responses=true needs the generate stage's "
            f"`finish_reason` column; the batch has only {sorted(table.column_names)}"
        )
    reasons = table.column("finish_reason").to_numpy(zero_copy_only=False)
    return np.asarray(reasons == "length", dtype=bool)


def place_scalar_at_last_token(
    values: Sequence[float], lengths: Sequence[int] | np.ndarray, width: int
) -> torch.Tensor:
    """(B, L) float32 zeros with `values[i]` at index `lengths[i]−1` (index −1 for an empty response,
    §6.2)."""
    out = torch.zeros(len(values), max(width, 1), dtype=torch.float32)
    for i, (v, ln) in enumerate(zip(values, lengths, strict=True)):
        out[i, ln - 1 if ln > 0 else -1] = float(v)
    return out


def compute_advantage_table(
    table: pa.Table,
    *,
    pad_token_id: int,
    adv_estimator: str,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    use_kl_in_reward: bool = False,
    kl_ctrl: Any = None,
    kl_penalty_kind: str = "kl",
    rollout_correction: Mapping[str, Any] | None = None,
    extra_kwargs: Mapping[str, Any] | None = None,
    mask_truncated_responses: bool = False,
) -> tuple[pa.Table, dict[str, float]]:
    """The advantage stage: token rewards (− β·KL), rollout correction (IS weights, RS mask),
    advantages/returns.

    Order as the reference trainer: KL-in-reward, then rollout correction (its RS mask zeroes advantages of
    rejected tokens; group statistics still use the unmasked scores), then the estimator grouped by `uid`.
    With `mask_truncated_responses` (the DAPO paper's overlong filtering), the rows that `truncated_rows`
    names get an all-zero `response_mask` after KL-in-reward and before rollout correction: their rewards
    still enter the group statistics, but no loss (actor, critic) and no IS normalisation counts their tokens.
    """
    metrics: dict[str, float] = {}
    cols = [
        c
        for c in ("old_log_probs", "rollout_log_probs", "ref_log_probs", "values")
        if c in table.column_names
    ]
    t = B.to_padded(table, pad_token_id, columns=cols)
    mask = t["response_mask"].float()
    lengths = B.response_lengths(table)
    scores = place_scalar_at_last_token(table.column("reward").to_pylist(), lengths, mask.shape[1])
    rewards = scores
    if use_kl_in_reward:
        from dapo_core.algo.kl import apply_kl_in_reward

        # bypass mode runs no old_log_prob stage: π_old is the rollout's policy
        old = t["old_log_probs"] if "old_log_probs" in t else t["rollout_log_probs"]
        rewards, kl_metrics = apply_kl_in_reward(
            scores, old, t["ref_log_probs"], mask, kl_ctrl, kl_penalty_kind
        )
        metrics.update(kl_metrics)
    if mask_truncated_responses:
        keep = torch.from_numpy(~truncated_rows(table))
        mask = mask * keep.to(mask.dtype).unsqueeze(-1)
    weights = None
    if rollout_correction and "rollout_log_probs" in t and "old_log_probs" in t:
        from dapo_core.algo.rollout_correction import RolloutCorrection, apply_rollout_correction

        rc = RolloutCorrection.from_dict(dict(rollout_correction))
        if not rc.bypass_mode:
            weights, new_mask, rc_metrics = apply_rollout_correction(
                t["old_log_probs"], t["rollout_log_probs"], mask, rc
            )
            mask = new_mask.float()
            metrics.update(rc_metrics)
    kwargs: dict[str, Any] = dict(extra_kwargs or {})
    kwargs.update(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    if "values" in t:
        kwargs["values"] = t["values"]
    index = table.column("uid").to_pylist()
    adv, ret = compute_advantage(adv_estimator, rewards, mask, index, **kwargs)
    out = table
    new_cols = {"token_level_rewards": rewards, "advantages": adv, "returns": ret}
    if weights is not None:
        new_cols["rollout_is_weights"] = weights
    for name, tensor in new_cols.items():
        out = B.add_token_column(out, name, tensor, "float32")
    out = B.add_token_column(out, "response_mask", mask.to(torch.int8), "int8")
    return out, metrics


def batch_data_metrics(table: pa.Table, pad_token_id: int) -> tuple[dict[str, float], dict[str, list[int]]]:
    """The §7.1 data metrics of a step's advantage view (``critic/*`` with ``critic/acc/mean``,
    ``response_length*``, ``prompt_length/*``) and its per-row ``prompt_length`` / ``response_length`` (what
    the §7.2 timing and throughput metrics count tokens from).

    Computed where the table is (a worker next to the run store): only these numbers and two integer lists
    go to the driver, never the token-level columns (gigabytes at the recipe's shape)."""
    t = B.to_padded(
        table,
        pad_token_id,
        columns=["advantages", "returns", "token_level_rewards"]
        + (["values"] if "values" in table.column_names else []),
    )
    t["token_level_scores"] = place_scalar_at_last_token(
        table.column("reward").to_pylist(), B.response_lengths(table), t["responses"].shape[1]
    )
    out = dict(compute_data_metrics(t, use_critic="values" in table.column_names))
    out["critic/acc/mean"] = float(
        sum(bool(a) for a in table.column("acc").to_pylist()) / max(table.num_rows, 1)
    )
    lengths = {k: [int(v) for v in t[k].tolist()] for k in ("prompt_length", "response_length")}
    return out, lengths
