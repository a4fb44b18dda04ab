"""Tests for dapo_core.algo.kl: estimators, straight-through variants, controllers, KL in reward."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    get_kl_controller,
    kl_penalty,
)

torch.set_num_threads(1)


def _pair(seed=0, shape=(3, 5), dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=g, dtype=dtype) * 3
    ref = -torch.rand(shape, generator=g, dtype=dtype) * 3
    return logp, ref


def test_estimator_values():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    d = logp - ref
    assert torch.equal(kl_penalty(logp, ref, "kl"), d)
    assert torch.equal(kl_penalty(logp, ref, "k1"), d)
    assert torch.equal(kl_penalty(logp, ref, "abs"), d.abs())
    assert torch.allclose(kl_penalty(logp, ref, "mse"), 0.5 * d**2)
    assert torch.allclose(kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    k3 = torch.exp(-d) + d - 1
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), k3)
    assert torch.allclose(kl_penalty(logp, ref, "k3"), k3)


def test_low_var_kl_clamps():
    logp = torch.tensor([-100.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -100.0], dtype=torch.float64)
    out = kl_penalty(logp, ref, "k3")
    assert out.tolist() == [10.0, 10.0]  # exp(20) − 21 and exp(−20) + 19 both clamped to 10
    mid = kl_penalty(torch.tensor([-1.0]), torch.tensor([-3.0]), "k3")
    assert mid.item() == pytest.approx(math.exp(-2) + 2 - 1)  # inside the bounds: no clamp
    huge = kl_penalty(torch.tensor([0.0]), torch.tensor([-1e4]), "k3")
    assert torch.isfinite(huge).all()


def test_unknown_and_full_raise():
    logp, ref = _pair()
    with pytest.raises(NotImplementedError, match="full"):
        kl_penalty(logp, ref, "full")
    with pytest.raises(NotImplementedError, match="Unknown"):
        kl_penalty(logp, ref, "k4")
    with pytest.raises(NotImplementedError):
        kl_penalty(logp, ref, "k4+")


@pytest.mark.parametrize("kind", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_value_is_base_gradient_is_k2(kind):
    logp, ref = _pair(1)
    lp1 = logp.clone().requires_grad_(True)
    value = kl_penalty(lp1, ref, kind)
    assert torch.allclose(value, kl_penalty(logp, ref, kind[:-1]), rtol=0, atol=1e-15)
    value.sum().backward()
    lp2 = logp.clone().requires_grad_(True)
    kl_penalty(lp2, ref, "k2").sum().backward()
    assert torch.allclose(lp1.grad, lp2.grad)
    assert torch.allclose(lp1.grad, logp - ref)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=8))
def test_k3_nonnegative_and_straight_through_property(pairs):
    logp = torch.tensor([p[0] for p in pairs], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    v = kl_penalty(logp, ref, "k3+")
    # k3 = e^x - x - 1 >= 0 exactly; in floats it may round to -1e-16 when logp and ref nearly agree
    assert (v >= -1e-12).all() and (v <= 10).all()
    (g,) = torch.autograd.grad(v.sum(), logp)
    assert torch.allclose(g, (logp - ref).detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl", "k3+"])
def test_dtype_preserved(dtype, kind):
    logp, ref = _pair(2, dtype=dtype)
    assert kl_penalty(logp, ref, kind).dtype == dtype


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(current_kl=10.0, n_steps=100)
    assert c.value == 0.05


def test_adaptive_controller_update():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    c.update(current_kl=0.15, n_steps=10)  # e = 0.5 → clipped to 0.2
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    c2 = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    c2.update(current_kl=0.09, n_steps=10)  # e = −0.1
    assert c2.value == pytest.approx(0.1 * (1 - 0.1 * 10 / 100))


def test_get_kl_controller():
    assert isinstance(get_kl_controller("fixed", 0.01, 10000, 0.1), FixedKLController)
    a = get_kl_controller("adaptive", kl_coef=0.2, horizon=50, target_kl=0.3)
    assert isinstance(a, AdaptiveKLController) and (a.value, a.horizon, a.target) == (0.2, 50, 0.3)
    from_cfg = get_kl_controller({"type": "adaptive", "kl_coef": 0.3, "horizon": 5, "target_kl": 0.2})
    assert isinstance(from_cfg, AdaptiveKLController) and from_cfg.value == 0.3
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", 0.1, 0, 0.1)
    with pytest.raises(NotImplementedError, match=re.escape("kl_ctrl.type")):
        get_kl_controller("pid", 0.1, 10, 0.1)


def test_apply_kl_in_reward():
    scores = torch.zeros(2, 3, dtype=torch.float64)
    scores[0, 1] = 1.0
    scores[1, 2] = -1.0
    old = torch.tensor([[-1.0, -1.0, -5.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -1.0, -0.4]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_in_reward(scores, old, ref, mask, ctrl, "kl")
    kld = (old - ref) * mask
    assert torch.allclose(rewards, scores - 0.1 * kld)
    assert rewards[0, 2].item() == 0.0  # padding untouched
    per_seq = [(0.5 + 1.0) / 2, (0 + 0 - 0.6) / 3]
    current = sum(per_seq) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # value before the update
    e = max(min(current / 0.1 - 1, 0.2), -0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + e * 2 / 10))  # n_steps = B = 2


def test_apply_kl_in_reward_fixed_and_empty_row():
    scores = torch.zeros(2, 2)
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -2.0], [-3.0, -3.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    ctrl = FixedKLController(0.5)
    rewards, metrics = apply_kl_in_reward(scores, old, ref, mask, ctrl, "k1")
    assert torch.allclose(rewards, torch.tensor([[-0.5, -0.5], [0.0, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)  # empty row counts as 0
    assert rewards.dtype == torch.float32


def test_apply_kl_in_reward_nonfinite_padding_does_not_leak():
    # −inf − −inf = NaN on padding must not reach the rewards (their row sums are the GRPO scores)
    scores = torch.tensor([[0.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, float("-inf")]])
    ref = torch.tensor([[-1.5, -2.0, float("-inf")]])
    mask = torch.tensor([[1, 1, 0]])
    rewards, metrics = apply_kl_in_reward(scores, old, ref, mask, FixedKLController(0.1), "kl")
    assert rewards.tolist() == [[pytest.approx(-0.05), pytest.approx(1.0 - 0.1), 0.0]]
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.75)


def test_low_var_kl_inner_clamp_keeps_float32_gradient_finite():
    # x = ref − logp = 100: without the inner ±20 clamp exp(x) overflows float32 to inf and the clamped
    # branch's zero gradient times inf is NaN; with it the gradient is exactly 0 (outer clamp active)
    logp = torch.tensor([-100.0, -1.0], requires_grad=True)
    ref = torch.tensor([0.0, -1.5])
    out = kl_penalty(logp, ref, "low_var_kl")
    assert out[0].item() == 10.0
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0].item() == 0.0
    assert logp.grad[1].item() == pytest.approx(1 - math.exp(-0.5))  # d/dlogp (e^x − x − 1), x = ref − logp
