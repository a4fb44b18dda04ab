"""Tests for dapo_core.metrics.step: hand-computed values and verl's fixtures (docs/REFERENCE.md §7, §10)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.metrics import step as M

torch.set_num_threads(1)


def dict_batch():
    """3 rows, P=2, L=3; row 2 is aborted (empty response)."""
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    response_mask = attention_mask[:, 2:].clone()
    scores = torch.tensor([[0, 0, 1.0], [0, -1.0, 0], [0, 0, 0]])
    return {
        "prompts": torch.zeros(3, 2, dtype=torch.long),
        "responses": torch.zeros(3, 3, dtype=torch.long),
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "token_level_scores": scores,
        "token_level_rewards": scores * 0.5,
        "advantages": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [99.0, 99.0, 99.0]]),
        "returns": torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]),
        "values": torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
    }


def test_compute_data_metrics_hand_computed():
    m = M.compute_data_metrics(dict_batch(), use_critic=True)
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
    b = dict_batch()
    b["attention_mask"][:, 2:] = 0
    b["response_mask"][:] = 0
    m = M.compute_data_metrics(b, use_critic=False)
    assert math.isnan(m["critic/score/mean"])
    assert math.isnan(m["response_length_non_aborted/mean"])
    assert m["response/aborted_ratio"] == 1.0
    assert "critic/values/mean" not in m and "critic/vf_explained_var" not in m


def test_compute_data_metrics_from_table():
    li = pa.list_(pa.int32())
    lf = pa.list_(pa.float32())
    t = pa.table(
        {
            "prompt_ids": pa.array([[1, 2], [3]], li),
            "response_ids": pa.array([[4, 5, 6], []], li),
            "reward": pa.array([1.0, -1.0], pa.float32()),
            "token_level_rewards": pa.array([[0, 0, 0.5], []], lf),
            "advantages": pa.array([[1, 1, 1], []], lf),
            "returns": pa.array([[0, 0, 0.5], []], lf),
        }
    )
    m = M.compute_data_metrics(t, use_critic=False, max_response_length=4)
    assert m["critic/score/mean"] == 1.0  # the aborted row (-1) is excluded
    assert m["critic/rewards/mean"] == 0.5
    assert m["response_length/clip_ratio"] == 0.0  # 3 < max 4
    assert m["response/aborted_ratio"] == 0.5
    assert m["prompt_length/max"] == 2.0


def test_timing_metrics():
    b = dict_batch()  # 5 response tokens, 10 prompt+response tokens
    m = M.compute_timing_metrics(b, {"gen": 0.5, "ref": 1.0, "step": 3.0, "update_actor": 2.0})
    assert m["timing_s/gen"] == 0.5 and m["timing_s/step"] == 3.0
    assert m["timing_per_token_ms/gen"] == pytest.approx(500 / 5)
    assert m["timing_per_token_ms/ref"] == pytest.approx(1000 / 10)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(2000 / 10)
    assert "timing_per_token_ms/step" not in m
    empty = {
        "prompts": torch.zeros(1, 0),
        "responses": torch.zeros(1, 0),
        "attention_mask": torch.zeros(1, 0),
    }
    assert M.compute_timing_metrics(empty, {"gen": 1.0})["timing_per_token_ms/gen"] == 0.0


@pytest.mark.parametrize("n_gpus", [1, 4])
def test_throughput_fixture(n_gpus):
    b = {"global_token_num": [100, 200, 300]}
    m = M.compute_throughout_metrics(b, {"step": 2.0}, n_gpus=n_gpus)
    assert m["perf/total_num_tokens"] == 600
    assert m["perf/time_per_step"] == 2.0
    assert m["perf/throughput"] == pytest.approx(600 / (2 * n_gpus))
    assert M.compute_throughout_metrics is M.compute_throughput_metrics


def test_variance_proxy():
    assert M.compute_variance_proxy_metrics({"advantages": torch.zeros(1, 1)}) == {}
    b = {
        "old_log_probs": torch.log(torch.tensor([[0.5, 0.5], [1.0, 0.25]])),
        "sum_pi_squared": torch.tensor([[0.5, 0.5], [1.0, 0.5]]),
        "advantages": torch.tensor([[2.0, 2.0], [-1.0, 7.0]]),
        "response_mask": torch.tensor([[1, 1], [1, 0]]),
    }
    m = M.compute_variance_proxy_metrics(b, gradient_norm=1.0)
    # w = 1 - 2π + Σπ²: row0 [0.5, 0.5] → W=1.0; row1 [0.0, -] → W=0; Ā = [2, -1]
    assert m["variance_proxy/proxy2_total_power"] == pytest.approx((4 * 1.0 + 1 * 0.0) / 2)
    assert m["variance_proxy/expected_a_squared"] == pytest.approx(2.5)
    assert m["variance_proxy/expected_w"] == pytest.approx(0.5)
    assert m["variance_proxy/proxy1_signal_strength"] == 1.0
    assert m["variance_proxy/proxy3_pure_noise"] == pytest.approx(1.0)  # (2 - 1)/(2-1)
    b["rollout_is_weights"] = torch.tensor([[2.0, 2.0], [1.0, 1.0]])
    m2 = M.compute_variance_proxy_metrics(b)
    assert m2["variance_proxy/proxy2_total_power"] == pytest.approx((4 * 4 * 1.0 + 1 * 1 * 0.0) / 2)
    assert m2["variance_proxy/proxy3_pure_noise"] == 0.0


def _reference_bootstrap(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
    """The reference's loop: global seed, one np.random.choice per resample, reduce a plain list."""
    np.random.seed(seed)
    lists = [[] for _ in reduce_fns]
    for _ in range(n_bootstrap):
        idx = np.random.choice(len(data), size=subset_size, replace=True)
        sample = [data[i] for i in idx]
        for lst, fn in zip(lists, reduce_fns):
            lst.append(fn(sample))
    return [(float(np.mean(lst)), float(np.std(lst))) for lst in lists]


def test_validation_fixture_mean_at_2():
    out = M.process_validation_metrics(
        ["source1", "source1", "source2"],
        ["uid1", "uid1", "uid2"],
        {"score": [0.8, 0.9, 0.7], "pred": ["A", "A", "B"]},
    )
    s1 = out["source1"]["score"]
    assert s1["mean@2"] == pytest.approx(0.85)
    assert s1["std@2"] == pytest.approx(0.05)
    assert "maj@2/mean" in s1 and "best@2/mean" in s1 and "worst@2/std" in s1
    votes = [{"val": 0.8, "pred": "A"}, {"val": 0.9, "pred": "A"}]
    [(maj_mean, maj_std)] = _reference_bootstrap(votes, 2, [lambda d: M.calc_maj_val(d, "pred", "val")])
    assert (s1["maj@2/mean"], s1["maj@2/std"]) == (pytest.approx(maj_mean), pytest.approx(maj_std))
    (best, worst) = _reference_bootstrap([0.8, 0.9], 2, [np.max, np.min])
    assert (s1["best@2/mean"], s1["best@2/std"]) == (pytest.approx(best[0]), pytest.approx(best[1]))
    assert (s1["worst@2/mean"], s1["worst@2/std"]) == (pytest.approx(worst[0]), pytest.approx(worst[1]))
    assert out["source2"]["score"] == {"mean@1": pytest.approx(0.7)}
    assert "pred" not in out["source1"]


def test_validation_ns_and_keys():
    uids = ["a"] * 5 + ["b"] * 5
    acc = [1, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    out = M.process_validation_metrics(["ds"] * 10, uids, {"acc": acc, "reward": acc}, with_pass_at_k=True)
    a = out["ds"]["acc"]
    assert a["mean@5"] == pytest.approx(0.4)
    assert {k.split("/")[0] for k in a if k.startswith("best")} == {"best@2", "best@4", "best@5"}
    # best ≥ mean ≥ worst
    assert a["best@4/mean"] >= a["mean@5"] >= a["worst@4/mean"]
    assert a["pass@1"] == pytest.approx((3 / 5 + 1 / 5) / 2)
    assert a["pass@5"] == 1.0
    keys = M.val_metrics_to_keys(out)
    assert "val-core/ds/acc/mean@5" in keys
    assert "val-core/ds/acc/best@5/mean" in keys
    assert "val-aux/ds/acc/best@4/mean" in keys
    assert "val-aux/ds/acc/std@5" in keys
    assert "val-aux/ds/reward/mean@5" in keys  # acc is the core variable when present


def test_bootstrap_matches_global_seed_stream():
    data = [0.1, 0.5, 0.9, 0.3]
    res = M.bootstrap_metric(data, 2, [np.max, np.min], n_bootstrap=50, seed=7)
    expected = _reference_bootstrap(data, 2, [np.max, np.min], n_bootstrap=50, seed=7)
    for got, want in zip(res, expected, strict=True):
        assert got == (pytest.approx(want[0], abs=1e-15), pytest.approx(want[1], abs=1e-15))
    # a subset size that does not divide the draw evenly, and more categories (the stream must still match)
    data = [float(i) for i in range(37)]
    res = M.bootstrap_metric(data, 5, [np.max, np.min, np.mean], n_bootstrap=300, seed=3)
    assert res == [
        (pytest.approx(a), pytest.approx(b))
        for a, b in _reference_bootstrap(data, 5, [np.max, np.min, np.mean], n_bootstrap=300, seed=3)
    ]
    before = np.random.get_state()[1][:5].copy()
    M.bootstrap_metric(data, 2, [np.max], seed=1)
    assert np.array_equal(np.random.get_state()[1][:5], before)  # global RNG untouched


def test_calc_maj_val():
    data = [{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "A", "val": 0.7}]
    assert M.calc_maj_val(data, vote_key="pred", val_key="val") == 0.9
    tie = [{"pred": "B", "val": 1}, {"pred": "A", "val": 2}]
    assert M.calc_maj_val(tie, vote_key="pred", val_key="val") == 1


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 30), data=st.data())
def test_pass_at_k_matches_combinatorial_definition(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    # probability that a random k-subset contains at least one correct sample
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert M.pass_at_k(n, c, k) == pytest.approx(expected)
    assert M.pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match="pass_at_k"):
        M.pass_at_k(3, 4, 1)


def test_spec_decode_fixtures():
    assert M.compute_spec_decode_metrics() == {}
    m = M.compute_spec_decode_metrics([4, 4], [0, 0], [2, 2])
    assert m == {"rollout/spec_accept_rate": 0.0, "rollout/spec_accept_length": 1.0}
    m = M.compute_spec_decode_metrics([3, 0], [3, 0], [1, 0], non_padding_mask=[True, False])
    assert m == {"rollout/spec_accept_rate": 1.0, "rollout/spec_accept_length": 4.0}
    with pytest.raises(AssertionError):
        M.compute_spec_decode_metrics([1], None, [1])


def test_moe_counts_exclude_last_token_and_metrics():
    # B=2, seqlen=4 (P=1, L=3), layers=1, topk=1, E=2
    routed = torch.tensor([[[[1]], [[0]], [[0]], [[1]]], [[[0]], [[1]], [[1]], [[0]]]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    counts = M.count_routed_experts(routed, mask, num_experts=2)
    # row0 response positions 1..3 → experts [0,0,1], last valid dropped → [0,0]; row1 → [1] (2nd is last)
    assert counts.tolist() == [[2, 1]]
    m = M.compute_moe_lb_metrics(counts)
    assert m["rollout/moe/max_vio/layer_0"] == pytest.approx(2 / 3 * 2 - 1)
    assert m["rollout/moe/min_vio/layer_0"] == pytest.approx(1 / 3 * 2 - 1)
    assert m["rollout/moe/avg_vio/layer_0"] == pytest.approx(1 / 3)
    assert m["rollout/moe/max_vio/max"] == m["rollout/moe/max_vio/layer_0"]
    assert m["rollout/moe/routed_expert_assignments"] == 3
    with pytest.warns(UserWarning):
        assert M.count_routed_experts(routed, mask, num_experts=1) is None
    acc = M.MoELoadBalanceAccumulator(num_experts=2, interval=2)
    acc.update(routed, mask)
    assert acc.maybe_emit(1) == {}
    acc.update(routed, mask)
    assert acc.maybe_emit(2)["rollout/moe/routed_expert_assignments"] == 6
    assert acc.maybe_emit(4) == {}  # reset after emission
    off = M.MoELoadBalanceAccumulator(2, interval=0)
    off.update(routed, mask)
    assert off.maybe_emit(0) == {}


def test_staleness_and_eviction():
    m = M.compute_staleness_metrics([3, 4], [4, 4], global_steps=6)
    assert m["training/off_policy/trajectory_spans/mean"] == 1.5
    assert m["training/off_policy/trajectory_staleness/max"] == 1
    assert m["training/off_policy/trajectory_staleness_worst/max"] == 2
    e = M.compute_eviction_metrics([2, 5], 6, "validation", filtered_groups=3)
    assert e["validation/off_policy/evicted_samples"] == 2
    assert e["validation/off_policy/evicted_samples_staleness/max"] == 5
    assert e["validation/filter_groups/evicted_samples"] == 3


def test_reduce_metrics_and_metric():
    r = M.reduce_metrics(
        {
            "a/max_x": [1, 5, 3],
            "a/min": [4, 2],
            "loss": [1.0, 2.0],
            "admin/x": [1, 3],
            "m": M.Metric("sum", [1, 2, 3]),
        }
    )
    assert r == {"a/max_x": 5.0, "a/min": 2.0, "loss": 1.5, "admin/x": 1.0, "m": 6.0}
    m = M.Metric(M.AggregationType.MAX)
    m.append(torch.tensor(2.0))
    m.append(3)
    assert m.aggregate() == 3.0
    with pytest.raises(ValueError, match="scalar"):
        m.append(torch.ones(2))
    ranks = [M.Metric("sum", [0.25, 0.25]), M.Metric("sum", [0.5, 0.5])]
    assert M.Metric.aggregate_dp(ranks) == pytest.approx(0.75)
    d: dict = {}
    M.append_to_dict(d, {"x": 1})
    M.append_to_dict(d, {"x": 2})
    assert d == {"x": [1, 2]}


def test_log_seqlen_unbalance():
    m = M.log_seqlen_unbalance([8, 1, 7, 2], [[0, 1], [2, 3]], prefix="global_seqlen")
    assert m == {
        "global_seqlen/min": 9,
        "global_seqlen/max": 9,
        "global_seqlen/minmax_diff": 0,
        "global_seqlen/balanced_min": 9,
        "global_seqlen/balanced_max": 9,
        "global_seqlen/mean": 9.0,
    }
    m = M.log_seqlen_unbalance([8, 7, 1, 2], [[0, 2], [1, 3]])
    assert m["global_seqlen/minmax_diff"] == 12 and m["global_seqlen/balanced_max"] == 9
