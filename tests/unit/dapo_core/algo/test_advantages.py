"""Tests for dapo_core.algo.advantages: registry, worked examples, vectorised == loop, GAE / REINFORCE++
masking."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.algo.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_advantage,
    factorize_index,
    get_adv_estimator,
    register_adv_estimator,
)
from dapo_core.masked import masked_whiten

torch.set_num_threads(1)

EPS = 1e-6


def _outcome(scores, L=3, lengths=None, dtype=torch.float32):
    """Token rewards with each score at the last valid token, plus the mask."""
    B = len(scores)
    lengths = lengths or [L] * B
    rewards = torch.zeros(B, L, dtype=dtype)
    mask = torch.zeros(B, L, dtype=torch.int8)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :n] = 1
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


# ------------------------------------------------------------------------------------------------ registry


def test_registry_contents_and_errors():
    expected = {
        "grpo",
        "grpo_vectorized",
        "rloo",
        "rloo_vectorized",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "gpg",
        "grpo_passk",
        "gae",
    }
    assert expected <= set(ADV_ESTIMATOR_REGISTRY)
    assert get_adv_estimator(AdvantageEstimator.GRPO) is get_adv_estimator("grpo")
    with pytest.raises(ValueError, match="Unknown advantage estimator"):
        get_adv_estimator("GRPO")  # case sensitive
    fn = get_adv_estimator("grpo")
    assert register_adv_estimator("grpo")(fn) is fn  # same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(lambda *a, **k: None)

    def custom(token_level_rewards, response_mask, index=None, **kwargs):
        """test estimator"""
        return token_level_rewards, token_level_rewards

    try:
        register_adv_estimator("_test_custom")(custom)
        r, m = _outcome([1.0])
        assert compute_advantage("_test_custom", r, m, None)[0] is r
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("_test_custom")


# ------------------------------------------------------------------------------------------------ GRPO


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized"])
def test_grpo_worked_example(name):
    r, m = _outcome([1.0, -1.0, -1.0, 1.0], lengths=[3, 2, 1, 3])
    adv, ret = compute_advantage(name, r, m, ["u"] * 4)
    expected = 1 / (math.sqrt(4 / 3) + EPS)  # unbiased std ⇒ ±0.8660, not ±1
    assert adv[0, 0].item() == pytest.approx(expected, rel=1e-6)
    assert adv[0, 0].item() == pytest.approx(0.8660, abs=1e-4)
    assert adv[1, 0].item() == pytest.approx(-expected, rel=1e-6)
    assert torch.equal(adv * m, adv)  # zero on padding
    assert adv[2, 1:].abs().sum().item() == 0.0
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized"])
def test_grpo_singleton_and_all_equal(name):
    r, m = _outcome([2.0, 0.5, 0.5, 0.5])
    adv, _ = compute_advantage(name, r, m, ["a", "b", "b", "b"])
    assert adv[0, 0].item() == pytest.approx(2.0 / (1 + EPS), rel=1e-7)  # singleton: r/(1+ε), not 0
    assert adv[1:].abs().max().item() == 0.0  # all-equal group


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized"])
def test_grpo_without_std_norm(name):
    r, m = _outcome([1.0, 0.0, 0.0, 3.0])
    adv, _ = compute_advantage(name, r, m, [1, 1, 2, 2], norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == pytest.approx([0.5, -0.5, -1.5, 1.5])


def test_grpo_requires_index_of_right_length():
    r, m = _outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", r, m, None)
    with pytest.raises(ValueError, match="one uid per trajectory"):
        compute_advantage("grpo_vectorized", r, m, ["a"])


def test_unknown_kwargs_are_ignored():
    r, m = _outcome([1.0, 0.0])
    a, _ = compute_advantage("grpo", r, m, ["a", "a"], gamma=0.9, lam=0.95, values=None, foo="bar")
    b, _ = compute_advantage("grpo", r, m, ["a", "a"])
    assert torch.equal(a, b)


def test_config_object_is_read():
    class Cfg:
        norm_adv_by_std_in_grpo = False
        gamma = 0.5

    r, m = _outcome([1.0, 0.0])
    a, _ = compute_advantage("grpo", r, m, ["a", "a"], config=Cfg())
    assert a[:, 0].tolist() == pytest.approx([0.5, -0.5])


# ----------------------------------------------------------------------------------------- vectorised == loop


@st.composite
def grouped(draw):
    """Group sizes ≥ 2, scores from a small set (many ties) or free floats, labels as str or int."""
    sizes = draw(st.lists(st.integers(2, 6), min_size=1, max_size=8))
    B = sum(sizes)
    free = draw(st.booleans())
    elem = st.floats(-5, 5, allow_nan=False, width=32) if free else st.sampled_from([0.0, 1.0, -1.0, 1.00001])
    scores = draw(st.lists(elem, min_size=B, max_size=B))
    labels = [g for g, n in enumerate(sizes) for _ in range(n)]
    perm = draw(st.permutations(list(range(B))))
    labels = [labels[i] for i in perm]
    if draw(st.booleans()):
        labels = [f"uid{g:03d}" for g in labels]
    return scores, labels


@settings(max_examples=60, deadline=None)
@given(grouped(), st.booleans())
def test_grpo_vectorized_matches_loop(data, norm):
    scores, labels = data
    r, m = _outcome(scores, L=2)
    a, _ = compute_advantage("grpo", r, m, labels, norm_adv_by_std_in_grpo=norm)
    b, _ = compute_advantage("grpo_vectorized", r, m, labels, norm_adv_by_std_in_grpo=norm)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(grouped())
def test_rloo_vectorized_matches_loop(data):
    scores, labels = data
    r, m = _outcome(scores, L=2)
    a, _ = compute_advantage("rloo", r, m, labels)
    b, _ = compute_advantage("rloo_vectorized", r, m, labels)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_low_variance_group_matches():
    r, m = _outcome([1.0, 1.00001, 1.0, 1.00001])
    a, _ = compute_advantage("grpo", r, m, ["x"] * 4)
    b, _ = compute_advantage("grpo_vectorized", r, m, ["x"] * 4)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert a.abs().max().item() > 0.1  # not collapsed to 0 by an epsilon inside the sqrt


def test_rloo_singletons_differ_by_design():
    r, m = _outcome([3.0, 1.0, 2.0])
    a, _ = compute_advantage("rloo", r, m, ["s", "g", "g"])
    b, _ = compute_advantage("rloo_vectorized", r, m, ["s", "g", "g"])
    assert a[0, 0].item() == 3.0 and b[0, 0].item() == 0.0
    assert a[1:, 0].tolist() == pytest.approx([-1.0, 1.0]) == b[1:, 0].tolist()


def test_factorize_index_kinds():
    ids, n = factorize_index(["b", "a", "b", "c"])
    assert n == 3 and ids[0] == ids[2] and len(set(ids.tolist())) == 3
    ids, n = factorize_index(torch.tensor([7, 3, 7]))
    assert n == 2 and ids.tolist() == [1, 0, 1]
    ids, n = factorize_index(np.array(["x", "y", "x"], dtype=object))
    assert n == 2 and ids[0] == ids[2]
    ids, n = factorize_index([5, 5, 9])
    assert n == 2 and ids.tolist() == [0, 0, 1]


# ----------------------------------------------------------------------------------- other outcome estimators


def test_opo_length_weighted_baseline():
    r, m = _outcome([1.0, 0.0, 5.0], L=4, lengths=[1, 3, 2])
    adv, _ = compute_advantage("opo", r, m, ["g", "g", "s"])
    b = (1 * 1.0 + 3 * 0.0) / 4
    assert adv[0, 0].item() == pytest.approx(1 - b)
    assert adv[1, :3].tolist() == pytest.approx([-b] * 3)
    assert adv[2, :2].tolist() == pytest.approx([5.0, 5.0])  # singleton baseline 0


def test_gpg_alpha_scaling():
    r, m = _outcome([1.0, 0.0, 0.0, 0.0])
    adv, _ = compute_advantage("gpg", r, m, ["g"] * 4)
    alpha = 4 / 1
    assert adv[:, 0].tolist() == pytest.approx([alpha * 0.75, -alpha * 0.25, -alpha * 0.25, -alpha * 0.25])


def test_grpo_passk():
    r, m = _outcome([0.0, 1.0, 0.5, 2.0, 2.0])
    adv, _ = compute_advantage("grpo_passk", r, m, ["a", "a", "a", "b", "b"], norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0, 0.0])
    adv, _ = compute_advantage("grpo_passk", r, m, ["a", "a", "a", "b", "b"])
    std = torch.tensor([0.0, 1.0, 0.5]).std().item()
    assert adv[1, 0].item() == pytest.approx(0.5 / (std + EPS), rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantage("grpo_passk", r, m, ["a", "a", "a", "b", "c"])


def test_reinforce_plus_plus_baseline_whitened():
    r, m = _outcome([1.0, 0.0, 2.0, 4.0], L=3, lengths=[3, 2, 1, 3], dtype=torch.float64)
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", r, m, ["a", "a", "b", "b"])
    centred = torch.tensor([0.5, -0.5, -1.0, 1.0], dtype=torch.float64)[:, None] * m
    assert torch.allclose(adv, masked_whiten(centred, m) * m)
    assert torch.equal(adv, ret)


def test_remax():
    r = torch.tensor([[0.0, 1.0, 0.5], [0.0, 2.0, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantage("remax", r, m, None, reward_baselines=torch.tensor([1.0, 0.5]))
    assert ret.tolist() == [[1.5, 1.5, 0.5], [2.0, 2.0, 0.0]]
    assert adv.tolist() == [[0.5, 0.5, -0.5], [1.5, 1.5, 0.0]]
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", r, m, None)


def test_reinforce_plus_plus_skips_observation_spans():
    gamma = 0.5
    # row with an observation span (mask 0) in the middle; compact equivalent drops those tokens
    r = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 0, 1, 1]])
    r2 = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]], dtype=torch.float64)
    m2 = torch.ones(2, 3, dtype=torch.int64)
    both_r = torch.cat([r, torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0]], dtype=torch.float64)])
    both_m = torch.cat([m, torch.tensor([[1, 1, 1, 0, 0]])])
    _, ret = compute_advantage("reinforce_plus_plus", both_r, both_m, None, gamma=gamma)
    _, ret2 = compute_advantage("reinforce_plus_plus", r2, m2, None, gamma=gamma)
    assert ret[0, [0, 3, 4]].tolist() == pytest.approx(ret2[0].tolist())
    assert ret[0, 1:3].tolist() == [0.0, 0.0]
    assert ret2[0].tolist() == pytest.approx([0.25, 0.5, 1.0])


# ------------------------------------------------------------------------------------------------ GAE


def _gae_reference(rewards, values, gamma, lam):
    """Textbook GAE on a compact (all-valid) row, in Python floats."""
    n = len(rewards)
    adv = [0.0] * n
    last, next_v = 0.0, 0.0
    for t in reversed(range(n)):
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
        next_v = values[t]
    return adv


def test_gae_matches_textbook_and_whitens():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, 4, generator=g, dtype=torch.float64)
    v = torch.randn(3, 4, generator=g, dtype=torch.float64)
    m = torch.ones(3, 4)
    adv, ret = compute_advantage("gae", r, m, None, values=v, gamma=0.9, lam=0.8)
    raw = torch.tensor(
        [_gae_reference(r[i].tolist(), v[i].tolist(), 0.9, 0.8) for i in range(3)], dtype=torch.float64
    )
    assert torch.allclose(ret, raw + v)
    assert torch.allclose(adv, masked_whiten(raw, m))
    assert adv.dtype == torch.float64


@settings(max_examples=30, deadline=None)
@given(st.floats(-100, 100), st.floats(-100, 100))
def test_gae_independent_of_values_at_observation_tokens(v_obs1, v_obs2):
    r = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0], [0.2, 0.0, 0.0, 0.0, -1.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 1, 1]])
    v = torch.tensor([[0.1, 0.2, 0.0, 0.0, 0.3], [0.4, 0.0, 0.5, 0.6, 0.7]], dtype=torch.float64)
    v1, v2 = v.clone(), v.clone()
    v1[m == 0] = v_obs1
    v2[m == 0] = v_obs2
    a1, r1 = compute_advantage("gae", r, m, None, values=v1, gamma=0.9, lam=0.95)
    a2, r2 = compute_advantage("gae", r, m, None, values=v2, gamma=0.9, lam=0.95)
    valid = m.bool()
    assert torch.allclose(a1[valid], a2[valid]) and torch.allclose(r1[valid], r2[valid])
    # the valid positions equal the compact row with the observation tokens removed
    compact = _gae_reference([0.0, 0.5, 1.0], [0.1, 0.2, 0.3], 0.9, 0.95)
    assert (r1[0, [0, 1, 4]] - v[0, [0, 1, 4]]).tolist() == pytest.approx(compact)


def test_gae_requires_values():
    r, m = _outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", r, m, None)


# ------------------------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "name",
    [
        "grpo",
        "grpo_vectorized",
        "rloo",
        "rloo_vectorized",
        "opo",
        "gpg",
        "reinforce_plus_plus_baseline",
        "reinforce_plus_plus",
        "grpo_passk",
    ],
)
def test_dtype_preserved_and_padding_zero(name, dtype):
    r, m = _outcome([1.0, 0.0, 2.0, 0.5], L=4, lengths=[4, 1, 2, 3], dtype=dtype)
    adv, ret = compute_advantage(name, r, m, ["a", "a", "b", "b"], gamma=1.0)
    assert adv.dtype == dtype and ret.dtype == dtype and adv.shape == r.shape
    assert adv[m == 0].abs().sum().item() == 0.0


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg"])
def test_empty_rows_and_length_one(name):
    # row 1 is an empty response (all masked); rows 2/3 have a single token
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    m = torch.tensor([[1, 1], [0, 0], [1, 0], [1, 0]])
    adv, _ = compute_advantage(name, r, m, ["a", "a", "b", "b"])
    assert torch.isfinite(adv).all()
    assert adv[1].abs().sum().item() == 0.0
    assert adv[2, 0].item() > 0 > adv[3, 0].item()


def test_whitening_estimators_reject_all_masked_batch():
    r = torch.zeros(2, 3)
    m = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="no valid entry"):
        compute_advantage("reinforce_plus_plus", r, m, None)


def test_arrow_uid_column_as_index():
    import pyarrow as pa

    uids = pa.chunked_array([pa.array(["u1", "u1"]), pa.array(["u2", "u2", "u1"])])
    r, m = _outcome([1.0, 0.0, 2.0, 0.0, 3.0])
    a, _ = compute_advantage("grpo_vectorized", r, m, uids)
    b, _ = compute_advantage("grpo", r, m, uids.to_pylist())
    c, _ = compute_advantage("grpo", r, m, uids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and torch.equal(b, c)
    ids, n = factorize_index(pa.array([3, 1, 3]))
    assert n == 2 and ids.tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="null"):
        factorize_index(pa.array(["a", None]))
