"""Tests for dapo_core.metrics.step and dapo_core.metrics.validation: hand-computed values and the reference
fixtures (docs/REFERENCE.md §7, §10)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.data import batch as B
from dapo_core.metrics import step as M
from dapo_core.metrics import validation as V
from dapo_core.stages import place_scalar_at_last_token

torch.set_num_threads(1)

LI = pa.list_(pa.int32())
LF = pa.list_(pa.float32())


def padded(table: pa.Table) -> dict:
    """The batch dict the train flow gives the step metrics: `to_padded` plus the scores at the last token."""
    cols = [c for c in ("advantages", "returns", "token_level_rewards", "values") if c in table.column_names]
    t = B.to_padded(table, 0, columns=cols)
    t["token_level_scores"] = place_scalar_at_last_token(
        table.column("reward").to_pylist(), B.response_lengths(table), t["responses"].shape[1]
    )
    return t


def batch_table() -> pa.Table:
    """3 rows: prompts of 2, 1, 2 tokens (P=2), responses of 3, 2, 0 tokens (L=3); row 2 is aborted."""
    return pa.table(
        {
            "prompt_ids": pa.array([[5, 6], [7], [8, 9]], LI),
            "response_ids": pa.array([[1, 2, 3], [4, 5], []], LI),
            "reward": pa.array([1.0, -1.0, 0.0], pa.float32()),
            "token_level_rewards": pa.array([[0, 0, 0.5], [0, -0.5], []], LF),
            "advantages": pa.array([[1.0, 2.0, 3.0], [4.0, 5.0], []], LF),
            "returns": pa.array([[1.0, 1.0, 1.0], [2.0, 2.0], []], LF),
            "values": pa.array([[1.0, 1.0, 1.0], [1.0, 1.0], []], LF),
        }
    )


def test_compute_data_metrics_hand_computed():
    m = M.compute_data_metrics(padded(batch_table()), use_critic=True)
    assert m["critic/score/mean"] == pytest.approx(0.0)  # rows 0,1: 1 and -1; row 2 aborted
    assert m["critic/score/max"] == 1.0 and m["critic/score/min"] == -1.0
    assert m["critic/rewards/mean"] == pytest.approx(0.0)
    assert m["critic/rewards/max"] == 0.5
    assert m["critic/advantages/mean"] == pytest.approx(3.0)  # 1..5 (masked)
    assert m["critic/advantages/max"] == 5.0
    assert m["critic/returns/mean"] == pytest.approx(7 / 5)
    assert m["critic/values/mean"] == pytest.approx(1.0)
    ret = torch.tensor([1.0, 1, 1, 2, 2])
    expected_ev = 1 - torch.var(ret - 1) / (torch.var(ret) + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(expected_ev.item())
    assert m["response_length/mean"] == pytest.approx(5 / 3)
    assert m["response_length/max"] == 3.0 and m["response_length/min"] == 0.0
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["response_length_non_aborted/mean"] == pytest.approx(2.5)
    assert m["response_length_non_aborted/min"] == 2.0
    assert m["response_length_non_aborted/clip_ratio"] == pytest.approx(0.5)
    assert m["response/aborted_ratio"] == pytest.approx(1 / 3)
    assert m["prompt_length/mean"] == pytest.approx(5 / 3)
    assert m["prompt_length/clip_ratio"] == pytest.approx(2 / 3)


def test_compute_data_metrics_all_aborted_is_nan_and_no_critic():
    t = batch_table()
    empty = pa.array([[], [], []], LF)
    for c in ("token_level_rewards", "advantages", "returns"):
        t = B.set_column(t, c, empty)
    t = B.set_column(t, "response_ids", pa.array([[], [], []], LI)).drop_columns(["values"])
    m = M.compute_data_metrics(padded(t), use_critic=False)
    assert math.isnan(m["critic/score/mean"])
    assert math.isnan(m["response_length_non_aborted/mean"])
    assert m["response/aborted_ratio"] == 1.0
    assert "critic/values/mean" not in m and "critic/vf_explained_var" not in m


def test_timing_metrics():
    b = padded(batch_table())  # 5 response tokens, 10 prompt+response tokens
    m = M.compute_timing_metrics(b, {"gen": 0.5, "ref": 1.0, "step": 3.0, "update_actor": 2.0})
    assert m["timing_s/gen"] == 0.5 and m["timing_s/step"] == 3.0
    assert m["timing_per_token_ms/gen"] == pytest.approx(500 / 5)
    assert m["timing_per_token_ms/ref"] == pytest.approx(1000 / 10)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(2000 / 10)
    assert "timing_per_token_ms/step" not in m
    empty = B.to_padded(pa.table({"prompt_ids": pa.array([[]], LI), "response_ids": pa.array([[]], LI)}), 0)
    assert M.compute_timing_metrics(empty, {"gen": 1.0})["timing_per_token_ms/gen"] == 0.0


@pytest.mark.parametrize("n_gpus", [1, 4])
def test_throughput(n_gpus):
    m = M.compute_throughput_metrics(padded(batch_table()), {"step": 2.0}, n_gpus=n_gpus)
    assert m["perf/total_num_tokens"] == 10
    assert m["perf/time_per_step"] == 2.0
    assert m["perf/throughput"] == pytest.approx(10 / (2 * n_gpus))
    with pytest.raises(KeyError, match="step"):
        M.compute_throughput_metrics(padded(batch_table()), {"gen": 1.0}, n_gpus=1)


# ------------------------------------------------------------------ validation metrics (§7.4)


def _reference_bootstrap(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    """The reference's loop: global seed, one np.random.choice per resample, reduce a plain list."""
    np.random.seed(seed)
    lists = [[] for _ in reduce_fns]
    for _ in range(n_bootstrap):
        idx = np.random.choice(len(data), size=subset_size, replace=True)
        sample = [data[i] for i in idx]
        for lst, fn in zip(lists, reduce_fns, strict=True):
            lst.append(fn(sample))
    return [(float(np.mean(lst)), float(np.std(lst))) for lst in lists]


def test_validation_fixture_mean_at_2():
    out = V.process_validation_metrics(
        ["source1", "source1", "source2"],
        ["uid1", "uid1", "uid2"],
        {"score": [0.8, 0.9, 0.7], "pred": ["A", "A", "B"]},
    )
    s1 = out["source1"]["score"]
    assert s1["mean@2"] == pytest.approx(0.85)
    assert s1["std@2"] == pytest.approx(0.05)
    assert "maj@2/mean" in s1 and "best@2/mean" in s1 and "worst@2/std" in s1
    votes = [{"val": 0.8, "pred": "A"}, {"val": 0.9, "pred": "A"}]
    [(maj_mean, maj_std)] = _reference_bootstrap(votes, 2, [lambda d: V.calc_maj_val(d, "pred", "val")])
    assert (s1["maj@2/mean"], s1["maj@2/std"]) == (pytest.approx(maj_mean), pytest.approx(maj_std))
    (best, worst) = _reference_bootstrap([0.8, 0.9], 2, [np.max, np.min])
    assert (s1["best@2/mean"], s1["best@2/std"]) == (pytest.approx(best[0]), pytest.approx(best[1]))
    assert (s1["worst@2/mean"], s1["worst@2/std"]) == (pytest.approx(worst[0]), pytest.approx(worst[1]))
    assert out["source2"]["score"] == {"mean@1": pytest.approx(0.7)}
    assert "pred" not in out["source1"]


def test_validation_ns_and_keys():
    uids = ["a"] * 5 + ["b"] * 5
    acc = [1, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    out = V.process_validation_metrics(["ds"] * 10, uids, {"acc": acc, "reward": acc})
    a = out["ds"]["acc"]
    assert a["mean@5"] == pytest.approx(0.4)
    assert {k.split("/")[0] for k in a if k.startswith("best")} == {"best@2", "best@4", "best@5"}
    # best ≥ mean ≥ worst
    assert a["best@4/mean"] >= a["mean@5"] >= a["worst@4/mean"]
    assert not any(k.startswith("pass@") for k in a)  # pass@k is pass_at_k_by_source's
    passk = V.pass_at_k_by_source(["ds"] * 10, uids, [float(x) for x in acc])
    assert passk["val-core/ds/acc/pass@1"] == pytest.approx((3 / 5 + 1 / 5) / 2)
    assert passk["val-core/ds/acc/pass@5"] == 1.0
    keys = V.val_metrics_to_keys(out)
    assert "val-core/ds/acc/mean@5" in keys
    assert "val-core/ds/acc/best@5/mean" in keys
    assert "val-aux/ds/acc/best@4/mean" in keys
    assert "val-aux/ds/acc/std@5" in keys
    assert "val-aux/ds/reward/mean@5" in keys  # acc is the core variable when present


def test_bootstrap_matches_global_seed_stream():
    data = [0.1, 0.5, 0.9, 0.3]
    res = V.bootstrap_metric(data, 2, [np.max, np.min], n_bootstrap=50, seed=7)
    expected = _reference_bootstrap(data, 2, [np.max, np.min], n_bootstrap=50, seed=7)
    for got, want in zip(res, expected, strict=True):
        assert got == (pytest.approx(want[0], abs=1e-15), pytest.approx(want[1], abs=1e-15))
    # a subset size that does not divide the draw evenly, and more categories (the stream must still match)
    data = [float(i) for i in range(37)]
    res = V.bootstrap_metric(data, 5, [np.max, np.min, np.mean], n_bootstrap=300, seed=3)
    assert res == [
        (pytest.approx(a), pytest.approx(b))
        for a, b in _reference_bootstrap(data, 5, [np.max, np.min, np.mean], n_bootstrap=300, seed=3)
    ]
    before = np.random.get_state()[1][:5].copy()
    V.bootstrap_metric(data, 2, [np.max], seed=1)
    assert np.array_equal(np.random.get_state()[1][:5], before)  # global RNG untouched


def test_calc_maj_val():
    data = [{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "A", "val": 0.7}]
    assert V.calc_maj_val(data, vote_key="pred", val_key="val") == 0.9
    tie = [{"pred": "B", "val": 1}, {"pred": "A", "val": 2}]
    assert V.calc_maj_val(tie, vote_key="pred", val_key="val") == 1


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 30), data=st.data())
def test_pass_at_k_matches_combinatorial_definition(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    # probability that a random k-subset contains at least one correct sample
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert V.pass_at_k(n, c, k) == pytest.approx(expected)
    assert V.pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match="pass_at_k"):
        V.pass_at_k(3, 4, 1)
