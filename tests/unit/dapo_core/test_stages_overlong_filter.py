"""Overlong filtering in the advantage stage (`compute_advantage_table(mask_truncated_responses=True)`): the
rows whose `finish_reason` is "length" leave the loss mask, and nothing else changes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_core.algo.losses import agg_loss
from dapo_core.data import batch as B
from dapo_core.stages import compute_advantage_table, truncated_rows

LENGTHS = [2, 4, 4, 1, 3, 4]
REWARDS = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
REASONS = ["stop", "length", "length", "stop", "stop", "length"]  # max_response_length 4


def _table(reasons: list[str] = REASONS) -> pa.Table:
    n = len(LENGTHS)
    return pa.table(
        {
            "uid": ["a"] * 3 + ["b"] * 3,
            "prompt_id": pa.array([0] * 3 + [1] * 3, pa.int64()),
            "sample_idx": pa.array([0, 1, 2] * 2, pa.int32()),
            "data_source": ["s"] * n,
            "ground_truth": ["1"] * n,
            "prompt_ids": pa.array([[5, 6]] * n, pa.list_(pa.int32())),
            "response_ids": pa.array([[7] * ln for ln in LENGTHS], pa.list_(pa.int32())),
            "rollout_log_probs": pa.array([[-0.5] * ln for ln in LENGTHS], pa.list_(pa.float32())),
            "old_log_probs": pa.array([[-0.5] * ln for ln in LENGTHS], pa.list_(pa.float32())),
            "finish_reason": reasons,
            "reward": pa.array(REWARDS, pa.float32()),
            "score": pa.array(REWARDS, pa.float32()),
            "acc": [r > 0 for r in REWARDS],
        }
    )


def test_truncated_rows_are_exactly_the_length_stops():
    assert truncated_rows(_table()).tolist() == [r == "length" for r in REASONS]
    assert not truncated_rows(_table(["stop"] * 6)).any()


def test_the_switch_masks_exactly_the_truncated_rows_and_keeps_the_group_statistics():
    plain, _ = compute_advantage_table(_table(), pad_token_id=0, adv_estimator="grpo")
    out, _ = compute_advantage_table(
        _table(), pad_token_id=0, adv_estimator="grpo", mask_truncated_responses=True
    )
    masks = out.column("response_mask").to_pylist()
    for mask, ln, reason in zip(masks, LENGTHS, REASONS, strict=True):
        assert mask == ([0] * ln if reason == "length" else [1] * ln)
    assert plain.column("response_mask").to_pylist() == [[1] * ln for ln in LENGTHS]
    adv, adv_plain = out.column("advantages").to_pylist(), plain.column("advantages").to_pylist()
    for row, row_plain, reason in zip(adv, adv_plain, REASONS, strict=True):
        if reason == "length":
            assert row == [0.0] * len(row)
        else:  # the truncated rows' rewards still enter the group mean and std
            assert row == row_plain and row[0] != 0.0


def test_token_mean_then_ignores_the_truncated_rows():
    out, _ = compute_advantage_table(
        _table(), pad_token_id=0, adv_estimator="grpo", mask_truncated_responses=True
    )
    mask = B.to_padded(out, 0, columns=[])["response_mask"].float()
    losses = torch.arange(1.0, 1.0 + mask.numel()).reshape(mask.shape)  # a distinct value per token
    kept = [i for i, r in enumerate(REASONS) if r != "length"]
    expected = np.mean([float(losses[i, j]) for i in kept for j in range(LENGTHS[i])])
    assert float(agg_loss(losses, mask, "token-mean")) == pytest.approx(expected)
    changed = losses.clone()
    changed[[i for i, r in enumerate(REASONS) if r == "length"]] = 1e6  # what truncated rows hold is unseen
    assert float(agg_loss(changed, mask, "token-mean")) == pytest.approx(expected)


def test_off_by_default_the_stage_is_bitwise_unchanged_and_a_batch_without_truncation_too():
    t = _table()
    default, _ = compute_advantage_table(t, pad_token_id=0, adv_estimator="grpo")
    off, _ = compute_advantage_table(t, pad_token_id=0, adv_estimator="grpo", mask_truncated_responses=False)
    assert default.equals(off)
    none = _table(["stop"] * 6)
    a, _ = compute_advantage_table(none, pad_token_id=0, adv_estimator="grpo")
    b, _ = compute_advantage_table(none, pad_token_id=0, adv_estimator="grpo", mask_truncated_responses=True)
    assert a.equals(b)


def test_a_batch_without_finish_reason_names_the_key():
    t = _table().drop(["finish_reason"])
    with pytest.raises(KeyError, match="mask_truncated_responses"):
        compute_advantage_table(t, pad_token_id=0, adv_estimator="grpo", mask_truncated_responses=True)
