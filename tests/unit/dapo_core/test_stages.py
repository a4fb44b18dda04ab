"""Driver-side stage logic: group filtering, truncation to train_batch_size·n, and the advantage stage."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_core.data import batch as B
from dapo_core.stages import (
    apply_group_filter,
    compute_advantage_table,
    exhausted_message,
    filter_metric_values,
    place_scalar_at_last_token,
    truncate_to_groups,
)


def _table(groups: list[list[float]], lengths=None) -> pa.Table:
    uids, sidx, rewards, acc = [], [], [], []
    for g, vals in enumerate(groups):
        for s, v in enumerate(vals):
            uids.append(f"u{g}")
            sidx.append(s)
            rewards.append(v)
            acc.append(v > 0)
    n = len(uids)
    lengths = lengths or [3] * n
    return pa.table(
        {
            "uid": uids,
            "prompt_id": pa.array(range(n), pa.int64()),
            "sample_idx": pa.array(sidx, pa.int32()),
            "data_source": ["s"] * n,
            "ground_truth": ["1"] * n,
            "prompt_ids": pa.array([[5, 6]] * n, pa.list_(pa.int32())),
            "response_ids": pa.array([[7] * ln for ln in lengths], pa.list_(pa.int32())),
            "rollout_log_probs": pa.array([[-0.5] * ln for ln in lengths], pa.list_(pa.float32())),
            "old_log_probs": pa.array([[-0.5] * ln for ln in lengths], pa.list_(pa.float32())),
            "reward": pa.array(rewards, pa.float32()),
            "score": pa.array(rewards, pa.float32()),
            "acc": acc,
        }
    )


def test_filter_keeps_varying_groups_in_order():
    t = _table([[1, 1], [1, -1], [-1, -1], [-1, 1]])
    out = apply_group_filter(t, "acc")
    assert out.num_groups == 4 and out.num_kept_groups == 2
    assert out.kept.column("uid").to_pylist() == ["u1", "u1", "u3", "u3"]
    assert out.metrics["train/filter_keep_rate"] == 0.5


def test_seq_reward_metric_reads_the_shaped_reward_and_unknown_metric_is_named():
    t = _table([[1, 1]])
    assert np.allclose(filter_metric_values(t, "seq_reward"), [1, 1])
    with pytest.raises(KeyError, match=r"filter_groups\.metric='nope'"):
        filter_metric_values(t, "nope")


def test_truncation_keeps_the_first_groups_and_counts_the_surplus():
    t = _table([[1, -1]] * 5)
    out, dropped = truncate_to_groups(t, 3, 2)
    assert out.num_rows == 6 and dropped == 2
    assert out.column("uid").to_pylist() == ["u0", "u0", "u1", "u1", "u2", "u2"]


def test_exhausted_message_is_the_reference_text_with_the_key():
    msg = exhausted_message(10, 10, 3, 512)
    assert msg.startswith("num_gen_batches=10 >= max_num_gen_batches=10. Generated too many.")
    assert "max_num_gen_batches=0" in msg and "algorithm.filter_groups.max_num_gen_batches" in msg


def test_reward_is_placed_at_the_last_valid_token_and_empty_rows_use_the_last_column():
    out = place_scalar_at_last_token([1.0, 2.0, 3.0], [2, 4, 0], 4)
    assert out.tolist() == [[0, 1, 0, 0], [0, 0, 0, 2], [0, 0, 0, 3]]


def test_advantage_stage_grpo_matches_the_worked_example():
    t = _table([[1, -1, -1, 1]], lengths=[2, 3, 1, 2])
    out, _ = compute_advantage_table(t, pad_token_id=0, adv_estimator="grpo")
    adv = out.column("advantages").to_pylist()
    expected = 1 / (np.sqrt(4 / 3) + 1e-6)
    for row, sign, ln in zip(adv, [1, -1, -1, 1], [2, 3, 1, 2], strict=True):
        assert len(row) == ln
        assert np.allclose(row, [sign * expected] * ln, atol=1e-6)
    assert out.column("response_mask").to_pylist() == [[1] * ln for ln in [2, 3, 1, 2]]


def test_advantage_stage_rejection_sampling_masks_tokens_but_keeps_group_stats():
    t = _table([[1, -1]], lengths=[2, 2])
    lp = pa.array([[-0.5, -0.5], [-0.5, -3.0]], pa.list_(pa.float32()))  # row 1 token 1: log-ratio -2.5
    t = t.set_column(t.column_names.index("old_log_probs"), "old_log_probs", lp)
    rc = {
        "rollout_is": None,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": "0.5_2.0",
        "bypass_mode": False,
    }
    out, metrics = compute_advantage_table(t, pad_token_id=0, adv_estimator="grpo", rollout_correction=rc)
    assert out.column("response_mask").to_pylist() == [[1, 1], [1, 0]]
    adv = out.column("advantages").to_pylist()
    assert adv[1][1] == 0.0 and adv[1][0] < 0 and adv[0][0] > 0
    assert any(k.startswith("rollout_corr/") for k in metrics)


def test_padded_round_trip_used_by_the_stage():
    t = _table([[1, -1]], lengths=[1, 3])
    p = B.to_padded(t, 0, columns=["old_log_probs"])
    assert p["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert torch.equal(p["old_log_probs"][1], torch.full((3,), -0.5))


def test_replay_order_keep_rate_is_the_checkpointed_one(monkeypatch):
    """The replay-buffer order feeds the run-wide keep-rate estimator that DriverState saves and restore()
    loads, so adaptive refill sizes survive a resume; its generation metrics fold into the step's as in the
    sync order."""
    from types import SimpleNamespace

    import flows.replay_order as ro
    from dapo_core.algo.dynamic_sampling import KeepRateEstimator
    from flows.run_setup import DriverState

    new = {
        "train/num_groups": 4.0,
        "train/num_kept_groups": 1.0,
        "timing_s/generate": 2.0,
        "perf/gen_tokens": 5.0,
    }
    monkeypatch.setattr(ro, "collect_generation", lambda run_id, step, tag: dict(new))
    est = KeepRateEstimator()
    rt = SimpleNamespace(
        run_id="keeprate",
        keep_rate=est,
        kl_ctrl=SimpleNamespace(value=0.5),
        sampler=SimpleNamespace(state_dict=dict),
    )
    metrics = {"timing_s/generate": 1.0, "perf/gen_tokens": 3.0}
    ro._collect(rt, 1, "ga", metrics)
    assert est.state_dict() == {"kept": 1.0, "seen": 4.0}
    assert metrics == {**new, "timing_s/generate": 3.0, "perf/gen_tokens": 8.0}
    assert DriverState().to_json(rt)["keep_rate_state"] == {"kept": 1.0, "seen": 4.0}


def test_step_data_metrics_computed_from_the_table_equal_the_padded_batch_path():
    """`batch_data_metrics` (run on a worker next to the store) gives exactly the metrics the driver used to
    compute from the whole padded advantage table, and its per-row lengths give the same timing and
    throughput metrics."""
    import math

    from dapo_core.metrics.step import (
        compute_data_metrics,
        compute_throughput_metrics,
        compute_timing_metrics,
    )
    from dapo_core.stages import batch_data_metrics

    t = _table([[1, -1, -1, 1], [1, 1, 1, -1]], lengths=[2, 3, 0, 2, 5, 1, 4, 3])
    table, _ = compute_advantage_table(t, pad_token_id=0, adv_estimator="grpo")
    padded = B.to_padded(table, 0, columns=["advantages", "returns", "token_level_rewards"])
    padded["token_level_scores"] = place_scalar_at_last_token(
        table.column("reward").to_pylist(), B.response_lengths(table), padded["responses"].shape[1]
    )
    want = dict(compute_data_metrics(padded, use_critic=False))
    want["critic/acc/mean"] = 5 / 8  # rewards > 0 are correct (`_table`)
    timing = {"step": 2.5, "gen": 1.0, "adv": 0.1, "update_actor": 0.7}
    want |= compute_timing_metrics(padded, timing) | compute_throughput_metrics(padded, timing, n_gpus=1)

    got, lengths = batch_data_metrics(table, pad_token_id=0)
    assert lengths["response_length"] == [2, 3, 0, 2, 5, 1, 4, 3] and lengths["prompt_length"] == [2] * 8
    counts = {k: torch.tensor(v) for k, v in lengths.items()} | {
        "prompts": torch.empty(0, 0),
        "responses": torch.empty(0, 0),
    }
    got |= compute_timing_metrics(counts, timing) | compute_throughput_metrics(counts, timing, n_gpus=1)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert (math.isnan(v) and math.isnan(got[k])) or got[k] == v, k
    assert got["response/aborted_ratio"] == 1 / 8  # the empty response counts as aborted
