"""Tests for dapo_core.algo.losses.core and dapo_core.masked: worked examples, gradients, global
normalisation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.algo.kl import kl_penalty
from dapo_core.algo.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    PolicyLossParams,
    actor_objective,
    agg_loss,
    compute_value_loss,
    get_policy_loss,
    register_policy_loss,
)
from dapo_core.masked import masked_mean, masked_sum, masked_var, masked_whiten

torch.set_num_threads(1)

DAPO = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}


def vanilla(old, log_prob, adv, mask, *, loss_agg_mode="token-mean", rollout_is_weights=None, **clip):
    """The registered `vanilla` loss (what `actor_objective` runs for DAPO) with keyword clip settings."""
    params = PolicyLossParams(**{"clip_ratio_c": 3.0, **clip})
    return get_policy_loss("vanilla")(
        old,
        log_prob,
        adv,
        mask,
        loss_agg_mode=loss_agg_mode,
        params=params,
        rollout_is_weights=rollout_is_weights,
    )


def _one_token(ratio: float, adv: float, dtype=torch.float64):
    """old=0, log_prob=log(ratio) as a (1,1) leaf, advantage, mask."""
    log_prob = torch.tensor([[math.log(ratio)]], dtype=dtype, requires_grad=True)
    return torch.zeros(1, 1, dtype=dtype), log_prob, torch.tensor([[adv]], dtype=dtype), torch.ones(1, 1)


# ------------------------------------------------------------------------------------------------ masked


def test_masked_sum_ignores_nonfinite_padding():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.int8)
    assert masked_sum(x, m).item() == 6.0
    assert torch.equal(masked_sum(x, m, axis=-1), torch.tensor([3.0, 3.0]))
    assert masked_mean(x, m).item() == pytest.approx(2.0)


def test_masked_sum_gradient_does_not_leak_nan():
    x = torch.tensor([[1.0, float("nan")]], requires_grad=True)
    masked_sum(x, torch.tensor([[1.0, 0.0]])).backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, 0.0]]))


def test_masked_mean_all_masked_is_zero():
    x = torch.randn(3, 4, dtype=torch.float64)
    assert masked_mean(x, torch.zeros(3, 4)).item() == 0.0


def test_masked_var_and_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 0]])
    assert masked_var(x, m).item() == pytest.approx(1.0, rel=1e-7)
    w = masked_whiten(x, m)
    assert w.dtype == torch.float64
    assert torch.allclose(w[0, :3], torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64), atol=1e-7)
    assert torch.allclose(masked_whiten(x, m, shift_mean=False)[0, :3], w[0, :3] + 2.0)
    with pytest.raises(ValueError, match="no valid entry"):
        masked_var(x, torch.zeros_like(m))
    with pytest.raises(ValueError, match="exactly one"):
        masked_var(x, torch.tensor([[1, 0, 0, 0]]))


# ------------------------------------------------------------------------------------------------ vanilla


def test_worked_example_dual_clip_negative_advantage():
    old, lp, adv, mask = _one_token(5.0, -1.0)
    loss, metrics = vanilla(old, lp, adv, mask, clip_ratio_c=3.0, **DAPO)
    assert loss.item() == pytest.approx(3.0)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1.0)
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(5.0))
    assert all(type(v) is float for v in metrics.values())
    loss.backward()
    assert lp.grad.abs().max().item() == 0.0  # A < 0, ratio > c: constant −A·c


def test_worked_example_clip_high_positive_advantage():
    old, lp, adv, mask = _one_token(1.5, 1.0)
    loss, metrics = vanilla(old, lp, adv, mask, clip_ratio_c=3.0, **DAPO)
    assert loss.item() == pytest.approx(-1.28)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    loss.backward()
    assert lp.grad.abs().max().item() == 0.0  # A > 0, ratio > 1 + ε_high


@pytest.mark.parametrize(
    ("ratio", "adv", "zero_grad"),
    [
        (0.5, -1.0, True),  # A < 0 and ratio < 1 − ε_low: clipped
        (1.1, 1.0, False),  # inside the trust region
        (0.5, 1.0, False),  # A > 0 below the range: the unclipped term is larger, gradient flows
        (2.0, -1.0, False),  # A < 0, 1 + ε_high < ratio < c: unclipped −A·ratio
        (1.0, 0.0, True),  # zero advantage
    ],
)
def test_gradient_regions(ratio, adv, zero_grad):
    old, lp, a, mask = _one_token(ratio, adv)
    loss, _ = vanilla(old, lp, a, mask, clip_ratio_c=3.0, **DAPO)
    loss.backward()
    if zero_grad:
        assert lp.grad.item() == 0.0
    else:
        # d/dlogp of −A·exp(logp − old) = −A·ratio
        assert lp.grad.item() == pytest.approx(-adv * ratio)


def test_dual_clip_only_for_negative_advantages():
    # A > 0 with a huge ratio is clipped at 1 + ε_high, never by c
    old, lp, adv, mask = _one_token(10.0, 2.0)
    loss, m = vanilla(old, lp, adv, mask, clip_ratio_c=3.0, **DAPO)
    assert loss.item() == pytest.approx(-2.0 * 1.28)
    assert m["actor/pg_clipfrac_lower"] == 0.0


def test_clip_ratio_c_must_exceed_one():
    old, lp, adv, mask = _one_token(1.0, 1.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        vanilla(old, lp, adv, mask, clip_ratio_c=1.0, **DAPO)


def test_log_ratio_clamped_at_20():
    # asymmetric so the metric tells clamped (−(20 + 0)/2) from unclamped (−(100 + 0)/2) apart
    old = torch.zeros(1, 2, dtype=torch.float32)
    lp = torch.tensor([[100.0, 0.0]], dtype=torch.float32, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float32)
    loss, m = vanilla(old, lp, adv, torch.ones(1, 2), clip_ratio_c=3.0, **DAPO)
    assert m["actor/ppo_kl"] == pytest.approx(-10.0)
    # token 0: A > 0, ratio clipped at 1 + ε_high; token 1: ratio 1 → (−1.28 + 1)/2
    assert loss.item() == pytest.approx((-1.28 + 1.0) / 2)
    loss.backward()
    # unclamped, exp(100) overflows float32 and the clipped branch's 0 gradient times inf is NaN
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 0].item() == 0.0


def test_clipfrac_is_strict_and_masked():
    # tokens: [A=0 at ratio 2 (L1 == L2: not clipped, strict >), A=+1 at ratio 1.1 (inside),
    #          A=+1 at ratio 2 (clipped high), A=−1 at ratio 5 (dual clip), A=−1 at ratio 2 (no dual clip),
    #          A=+1 at ratio 2 but masked out]
    ratios = [2.0, 1.1, 2.0, 5.0, 2.0, 2.0]
    adv = torch.tensor([[0.0, 1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    lp = torch.log(torch.tensor([ratios], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, m = vanilla(torch.zeros(1, 6, dtype=torch.float64), lp, adv, mask, clip_ratio_c=3.0, **DAPO)
    # L2 > L1 only for token 2 (−1.28 > −2); token 0 has L1 == L2 == 0, tokens 3/4 have L1 > L2 (A < 0),
    # token 5 is masked → 1 of the 5 valid tokens
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 5)
    # dual clip: Lclip = 5 > 3 for token 3 only (token 4: Lclip = 2 < 3; token 2 has A > 0)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    # per-token losses: 0, −1.1, −1.28, 3 (= −A·c), 2 → mean over 5 valid tokens
    assert loss.item() == pytest.approx((0.0 - 1.1 - 1.28 + 3.0 + 2.0) / 5)


def test_masked_tokens_and_is_weights():
    old = torch.zeros(2, 3)
    lp = torch.log(torch.tensor([[1.1, 0.9, 50.0], [1.0, 1.0, 1.0]]))
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, _ = vanilla(old, lp, adv, mask, **DAPO)
    expected = (-1.1 - 0.9 + 1.0 + 1.0) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    w = torch.tensor([[2.0, 1.0, 7.0], [0.5, 0.5, 7.0]])
    loss_w, _ = vanilla(old, lp, adv, mask, rollout_is_weights=w, **DAPO)
    assert loss_w.item() == pytest.approx((-2.2 - 0.9 + 0.5 + 0.5) / 4, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_preserved(dtype):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g, dtype=dtype)
    lp = old + 0.1 * torch.randn(3, 5, generator=g, dtype=dtype)
    adv = torch.randn(3, 5, generator=g, dtype=dtype)
    mask = torch.ones(3, 5, dtype=torch.int8)
    for mode in LOSS_AGG_MODES:
        loss, _ = vanilla(old, lp, adv, mask, loss_agg_mode=mode, **DAPO)
        assert loss.dtype == dtype
    vf, frac = compute_value_loss(lp, adv, old, mask, 0.5)
    assert vf.dtype == dtype and frac.dtype == dtype


def test_params_fallback_to_clip_ratio():
    p = PolicyLossParams(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None)
    assert (p.eps_low, p.eps_high) == (0.3, 0.3)


# ------------------------------------------------------------------------------------------------ registry


REGISTERED_LOSSES = (
    "vanilla",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dppo_tv",
    "dppo_kl",
    "cispo",
    "dro",
    "reinforce",
    "bypass_mode",
)
"""Every loss the registry must hold (verl's NEWEST set)."""


def test_registry_names_and_errors():
    expected = set(REGISTERED_LOSSES)
    assert expected <= set(POLICY_LOSS_REGISTRY)
    with pytest.raises(ValueError, match=r"Unsupported loss mode.*Supported modes are"):
        get_policy_loss("nope")

    @register_policy_loss("_test_tmp")
    def tmp(*a, **k):
        """temporary"""
        return torch.zeros(()), {}

    try:
        assert get_policy_loss("_test_tmp") is tmp
    finally:
        POLICY_LOSS_REGISTRY.pop("_test_tmp")


def _random_batch(seed=0, B=4, L=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, L, generator=g, dtype=dtype) * 2 - 0.05
    lp = (old + 0.3 * torch.randn(B, L, generator=g, dtype=dtype)).clamp(max=-1e-3).requires_grad_(True)
    adv = torch.randn(B, L, generator=g, dtype=dtype)
    mask = torch.ones(B, L, dtype=torch.int64)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    return old, lp, adv * mask, mask


@pytest.mark.parametrize("name", [n for n in REGISTERED_LOSSES if n != "bypass_mode"])
def test_every_registered_loss_runs_and_backprops(name):
    torch.manual_seed(0)
    old, lp, adv, mask = _random_batch()
    params = PolicyLossParams(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=10.0,
        dro_beta=0.5,
        clip_cov_ratio=0.2,
        kl_cov_ratio=0.2,
    )
    loss, metrics = get_policy_loss(name)(old, lp, adv, mask, loss_agg_mode="token-mean", params=params)
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.dtype == torch.float64
    assert all(type(v) is float for v in metrics.values())
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[mask == 0] == 0).all() or name == "geo_mean"


def test_gpg_and_reinforce_formulas():
    old, lp, adv, mask = _random_batch(3)
    expected = agg_loss(-adv * lp, mask, "seq-mean-token-sum")
    loss, metrics = get_policy_loss("gpg")(old, lp, adv, mask, loss_agg_mode="seq-mean-token-sum")
    assert torch.allclose(loss, expected) and metrics == {}
    loss, metrics = get_policy_loss("reinforce")(old, lp, adv, mask, loss_agg_mode="seq-mean-token-sum")
    assert torch.allclose(loss, expected)
    assert metrics["actor/ppo_kl"] == pytest.approx(masked_mean(old - lp, mask).item())


def test_dro_formula_and_beta_required():
    old, lp, adv, mask = _random_batch(4)
    beta = 0.7
    loss, _ = get_policy_loss("dro")(old, lp, adv, mask, params=PolicyLossParams(dro_beta=beta))
    expected = agg_loss(-(lp * adv - 0.5 * beta * (lp - old) ** 2), mask, "token-mean")
    assert torch.allclose(loss, expected)
    with pytest.raises(ValueError, match="dro_beta"):
        get_policy_loss("dro")(old, lp, adv, mask, params=PolicyLossParams())


def test_cispo_clips_weight_not_gradient():
    old, lp, adv, mask = _one_token(2.0, 1.0)
    loss, m = get_policy_loss("cispo")(old, lp, adv, mask, params=PolicyLossParams(clip_ratio_high=0.28))
    assert loss.item() == pytest.approx(-1.28 * math.log(2.0))
    assert m["actor/pg_clipfrac"] == pytest.approx(1.0)
    loss.backward()
    assert lp.grad.item() == pytest.approx(-1.28)  # gradient still flows through log π


def test_gspo_sequence_ratio_and_forced_mode():
    old = torch.zeros(1, 2, dtype=torch.float64)
    lp = torch.tensor([[0.1, 0.3]], dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, m = get_policy_loss("gspo")(
        old,
        lp,
        adv,
        torch.ones(1, 2),
        loss_agg_mode="token-sum",
        params=PolicyLossParams(clip_ratio_high=0.5),
    )
    s = math.exp(0.2)  # exp(mean log ratio)
    assert loss.item() == pytest.approx(-s)  # seq-mean-token-mean, not token-sum
    assert m["actor/pg_clipfrac_lower"] == 0.0


def test_sapo_gate_at_ratio_one():
    old, lp, adv, mask = _one_token(1.0, 2.0)
    loss, _ = get_policy_loss("sapo")(old, lp, adv, mask)
    assert loss.item() == pytest.approx(-2.0 * 0.5 * 4.0 / 1.0)  # sigmoid(0)·4/τ_pos·A


def test_geo_mean_sign_aware_clip():
    old = torch.zeros(1, 2, dtype=torch.float64)
    lp = torch.tensor([[0.5, 0.0]], dtype=torch.float64)  # token 0 above ε_high
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, m = get_policy_loss("geo_mean")(
        old, lp, adv, torch.ones(1, 2), params=PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28)
    )
    assert loss.item() == pytest.approx(-math.exp(0.28 / 2))
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_kl_cov_penalises_top_covariance_token():
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.tensor([[-0.1, -0.2, -0.3, -2.0]], dtype=torch.float64)
    adv = torch.tensor([[0.0, 0.0, 0.0, -3.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    p = PolicyLossParams(kl_cov_ratio=0.25, ppo_kl_coef=0.1)
    loss, m = get_policy_loss("kl_cov")(old, lp, adv, mask, loss_agg_mode="token-sum", params=p)
    base = (-adv * torch.exp(lp)).sum().item()
    assert loss.item() == pytest.approx(base + 0.1 * 2.0)
    assert m["actor/ppo_kl"] == pytest.approx(2.6 / 4)


def test_dppo_tv_invalidates_large_moves():
    old = torch.log(torch.tensor([[0.2, 0.2]], dtype=torch.float64))
    lp = torch.log(torch.tensor([[0.9, 0.25]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, m = get_policy_loss("dppo_tv")(old, lp, adv, torch.ones(1, 2), loss_agg_mode="token-sum")
    assert m["actor/pg_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() != 0.0


def test_bypass_mode_ppo_clip_and_reinforce():
    old, lp, adv, mask = _random_batch(5)
    p = PolicyLossParams(rollout_correction={"loss_type": "ppo_clip"})
    loss, m = get_policy_loss("bypass_mode")(
        old, lp, adv, mask, params=p, rollout_is_weights=torch.full_like(old, 9.0)
    )
    ref, _ = vanilla(old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert torch.allclose(loss, ref)  # ratio against π_rollout, no IS weights
    assert any(k.startswith("rollout_corr/") for k in m) and "actor/pg_clipfrac" in m
    p = PolicyLossParams(
        rollout_correction={"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 2.0}
    )
    loss, m = get_policy_loss("bypass_mode")(old, lp, adv, mask, params=p)
    w = torch.exp(lp.detach() - old).clamp(max=2.0) * mask
    assert torch.allclose(loss, agg_loss(-adv * lp * w, mask, "token-mean"))


# ------------------------------------------------------------------------------------------------ agg_loss


def test_agg_loss_modes_worked_example():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert agg_loss(x, m, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(x, m, "token-sum").item() == pytest.approx(10)
    assert agg_loss(x, m, "token-sum", dp_size=3).item() == pytest.approx(30)
    assert agg_loss(x, m, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)  # empty row excluded
    assert agg_loss(x, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(5 / 3)  # ÷ padded L
    assert agg_loss(x, m, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.5)
    # global info: divide by the configured trajectory count including the empty row
    assert agg_loss(x, m, "seq-mean-token-sum", global_batch_size=3).item() == pytest.approx(10 / 3)
    assert agg_loss(x, m, "token-mean", batch_num_tokens=8, dp_size=2).item() == pytest.approx(10 / 8 * 2)


def test_agg_loss_errors():
    x, m = torch.ones(2, 2), torch.ones(2, 2)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        agg_loss(x, m, "mean")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(x, m, "token-mean", dp_size=2)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match="global_batch_size"):
            agg_loss(x, m, mode, dp_size=2)
    with pytest.raises(ValueError, match="shape"):
        agg_loss(x, torch.ones(2, 3), "token-mean")


def test_agg_loss_all_masked_batch():
    x = torch.randn(2, 3)
    m = torch.zeros(2, 3)
    assert math.isnan(agg_loss(x, m, "token-mean").item())  # documented: 0/0 like the reference
    assert agg_loss(x, m, "token-sum").item() == 0.0
    assert agg_loss(x, m, "token-mean", batch_num_tokens=10).item() == 0.0
    assert agg_loss(x, m, "seq-mean-token-mean", global_batch_size=2).item() == 0.0
    assert masked_mean(x, m).item() == 0.0


def test_length_one_responses():
    x = torch.tensor([[2.0], [4.0]])
    m = torch.ones(2, 1)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert agg_loss(x, m, mode).item() == pytest.approx(3.0)


@st.composite
def ragged_batches(draw):
    """A (B, L) float64 loss with ragged lengths (some rows empty), a split into parts, and dp size."""
    B = draw(st.integers(1, 7))
    L = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, L), min_size=B, max_size=B))
    vals = draw(st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=B * L, max_size=B * L))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(B - 1, 1)), max_size=3)))) if B > 1 else []
    loss = torch.tensor(vals, dtype=torch.float64).reshape(B, L)
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int8)
    bounds = [0, *[c for c in cuts if 0 < c < B], B]
    return loss, mask, bounds


@settings(max_examples=60, deadline=None)
@given(ragged_batches(), st.sampled_from(LOSS_AGG_MODES))
def test_agg_loss_micro_batch_invariance(batch, mode):
    loss, mask, bounds = batch
    info = {"batch_num_tokens": int(mask.sum()), "global_batch_size": loss.shape[0], "loss_scale_factor": 7.0}
    leaf_whole = loss.clone().requires_grad_(True)
    whole = agg_loss(leaf_whole, mask, mode, **info)
    whole.backward()
    leaf_parts = loss.clone().requires_grad_(True)
    parts = sum(agg_loss(leaf_parts[a:b], mask[a:b], mode, **info) for a, b in itertools.pairwise(bounds))
    parts.backward()
    if mode == "token-mean" and int(mask.sum()) == 0:
        assert math.isnan(whole.item())
        return
    assert parts.item() == pytest.approx(whole.item(), rel=1e-9, abs=1e-9)
    assert torch.allclose(leaf_parts.grad, leaf_whole.grad, rtol=1e-9, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(ragged_batches(), st.sampled_from(LOSS_AGG_MODES))
def test_agg_loss_dp_shard_mean_equals_global(batch, mode):
    loss, mask, bounds = batch
    dp = len(bounds) - 1
    info = {"batch_num_tokens": int(mask.sum()), "global_batch_size": loss.shape[0], "loss_scale_factor": 7.0}
    whole = agg_loss(loss, mask, mode, **info)
    shards = [agg_loss(loss[a:b], mask[a:b], mode, dp_size=dp, **info) for a, b in itertools.pairwise(bounds)]
    mean = torch.stack(shards).mean()
    if mode == "token-mean" and int(mask.sum()) == 0:
        return
    assert mean.item() == pytest.approx(whole.item(), rel=1e-9, abs=1e-9)


def test_token_mean_fallback_equals_global_for_single_batch():
    loss, mask, _ = _random_batch(7)[1], _random_batch(7)[3], None
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(
        agg_loss(loss, mask, "token-mean", batch_num_tokens=int(mask.sum())).item()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_agg_loss_dtype(dtype):
    x = torch.randn(3, 4, dtype=dtype)
    m = torch.ones(3, 4, dtype=torch.bool)
    for mode in LOSS_AGG_MODES:
        assert agg_loss(x, m, mode).dtype == dtype


# ------------------------------------------------------------------------------------------------ value loss


def test_value_loss_worked_example():
    vpreds = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    # token 0: vpred 1 clipped to 0.5 → (0.5)² = 0.25 < 1 → max is 1; clipfrac counts vclip loss > vpred loss
    loss, frac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.0) / 2)
    assert frac.item() == 0.0
    # vpred moves away from a return that lies on the other side of the old value → clipped term larger
    loss, frac = compute_value_loss(
        torch.tensor([[2.0]]),
        torch.tensor([[1.8]]),
        torch.tensor([[0.0]]),
        torch.ones(1, 1),
        cliprange_value=0.5,
    )
    assert loss.item() == pytest.approx(0.5 * (0.5 - 1.8) ** 2)
    assert frac.item() == pytest.approx(1.0)


@settings(max_examples=40, deadline=None)
@given(ragged_batches(), st.sampled_from(LOSS_AGG_MODES))
def test_value_loss_micro_batch_invariance(batch, mode):
    returns, mask, bounds = batch
    g = torch.Generator().manual_seed(0)
    values = torch.randn(returns.shape, generator=g, dtype=torch.float64)
    vpreds = (values + torch.randn(returns.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    info = {
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": returns.shape[0],
        "loss_scale_factor": 3.0,
    }
    if mode == "token-mean" and int(mask.sum()) == 0:
        return
    whole, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, mode, **info)
    (g_whole,) = torch.autograd.grad(whole, vpreds)
    parts = sum(
        compute_value_loss(vpreds[a:b], returns[a:b], values[a:b], mask[a:b], 0.5, mode, **info)[0]
        for a, b in itertools.pairwise(bounds)
    )
    (g_parts,) = torch.autograd.grad(parts, vpreds)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-9, abs=1e-9)
    assert torch.allclose(g_parts, g_whole, rtol=1e-9, atol=1e-12)


def test_value_loss_scale_factor():
    r, m = torch.randn(2, 4, dtype=torch.float64), torch.ones(2, 4)
    v = torch.zeros(2, 4, dtype=torch.float64)
    p = r + 0.1
    a, fa = compute_value_loss(p, r, v, m, 0.5, "seq-mean-token-sum-norm", loss_scale_factor=2.0)
    b, fb = compute_value_loss(p, r, v, m, 0.5, "seq-mean-token-sum-norm", loss_scale_factor=4.0)
    assert a.item() == pytest.approx(2 * b.item()) and fa.item() == fb.item()


# -------------------------------------------------------------------------------------------- actor objective


def test_actor_objective_combines_terms():
    old, lp, adv, mask = _random_batch(11)
    ent = torch.full_like(old, 2.0)
    ref_lp = lp.detach() - 0.5
    pg, pg_m = vanilla(old, lp, adv, mask, clip_ratio_c=10.0, **DAPO)
    params = PolicyLossParams(clip_ratio_c=10.0, **DAPO)
    common = {"loss_mode": "vanilla", "params": params}
    loss, m = actor_objective(
        old, lp, adv, mask, **common, entropy=ent, entropy_coeff=0.1, ref_log_prob=ref_lp, kl_loss_coef=0.01
    )
    kl = agg_loss(kl_penalty(lp, ref_lp, "low_var_kl"), mask, "token-mean")
    assert loss.item() == pytest.approx(pg.item() - 0.1 * 2.0 + 0.01 * kl.item())
    assert m["actor/pg_loss"] == pg.item()  # the policy loss alone, as verl logs it
    assert m["actor/entropy_loss"] == pytest.approx(2.0) and m["actor/kl_coef"] == 0.01
    assert m["actor/kl_loss"] == pytest.approx(kl.item())
    assert {k: m[k] for k in pg_m} == pg_m
    loss, m = actor_objective(old, lp, adv, mask, **common)
    assert loss.item() == pg.item() and set(m) == {*pg_m, "actor/pg_loss"}
    # entropy is reported but not added with entropy_coeff=0 (DAPO)
    loss0, m0 = actor_objective(old, lp, adv, mask, **common, entropy=ent)
    assert loss0.item() == pg.item() and m0["actor/entropy_loss"] == pytest.approx(2.0)
