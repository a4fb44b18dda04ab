"""Adaptive refill by expected surplus (`surplus_bounded_size`, `flows.run_setup.refill_size`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dapo_core.algo.dynamic_sampling import KeepRateEstimator, expected_surplus, surplus_bounded_size
from dapo_core.config import ConfigError, load_config, typed
from flows.step_support import refill_size


def test_expected_surplus_is_the_binomial_expectation():
    for size, p, d in ((20, 0.85, 16), (7, 0.3, 2), (40, 0.6, 16)):
        exact = sum(
            (k - d) * math.comb(size, k) * p**k * (1 - p) ** (size - k) for k in range(d + 1, size + 1)
        )
        assert expected_surplus(size, p, d) == pytest.approx(exact, rel=1e-10)
    assert expected_surplus(16, 0.9, 16) == 0.0  # a batch no larger than the deficit cannot overshoot
    assert expected_surplus(30, 1.0, 16) == 14.0 and expected_surplus(30, 0.0, 16) == 0.0


def test_surplus_bounded_size_is_the_largest_batch_within_the_budget():
    for d, p, budget in ((16, 0.85, 0.08), (16, 0.6, 0.32), (512, 0.4, 2.56), (3, 0.5, 0.0)):
        s = surplus_bounded_size(d, p, surplus_budget=budget, base=32)
        assert s >= d
        assert s == d or expected_surplus(s, p, d) <= budget
        assert expected_surplus(s + 1, p, d) > budget
    assert surplus_bounded_size(16, 0.5, surplus_budget=0.0, base=32) == 16
    assert surplus_bounded_size(16, None, surplus_budget=0.1, base=32) == 32  # no rate observed yet
    assert surplus_bounded_size(0, 0.5, surplus_budget=0.1, base=32) == 0
    assert surplus_bounded_size(100, 0.01, surplus_budget=1e9, base=32, max_size=500) == 500
    with pytest.raises(ValueError, match="surplus_budget"):
        surplus_bounded_size(4, 0.5, surplus_budget=-1.0, base=32)


def test_the_budget_bounds_the_surplus_of_a_simulated_run():
    """A simulated step loop at a constant keep rate: the surplus stays near the budget's order (far below
    fixed refills), and every step fills its batch."""
    rng = np.random.default_rng(0)
    est = KeepRateEstimator(decay=0.9)
    need, surplus, rounds = 16, 0, 0
    for _ in range(200):
        kept = 0
        while kept < need:
            size = surplus_bounded_size(need - kept, est.rate, surplus_budget=0.005 * need, base=32)
            k = int(rng.binomial(size, 0.6))
            est.update(k, size)
            kept += k
            rounds += 1
        surplus += kept - need
    assert surplus / (200 * need) < 0.02
    assert rounds / 200 < 4


def _cfg(*overrides: str):
    return typed(load_config("configs/tiny_cpu.yaml", list(overrides)))


def test_refill_size_follows_the_config():
    est = KeepRateEstimator(decay=1.0)
    est.update(24, 32)  # keep rate 0.75
    # refill=fixed (the schema default, the reference): always the fixed size
    assert refill_size(_cfg("algorithm.filter_groups.refill=fixed"), est, 16, fixed=32) == 32
    cfg = _cfg("algorithm.filter_groups.refill=adaptive", "algorithm.filter_groups.surplus_budget=0.005")
    s = refill_size(cfg, est, 16, fixed=32)
    assert s == surplus_bounded_size(16, 0.75, surplus_budget=0.005 * 16, base=32) and 16 <= s < 32
    wide = _cfg("algorithm.filter_groups.refill=adaptive", "algorithm.filter_groups.surplus_budget=0.1")
    assert refill_size(wide, est, 16, fixed=32) > s
    # the CPU default (configs/tiny_cpu.yaml) sizes by the keep rate with a budget of 0.1
    assert refill_size(_cfg(), est, 16, fixed=32) == refill_size(wide, est, 16, fixed=32)
    assert refill_size(cfg, est, 0, fixed=32) == 0
    with pytest.raises(ConfigError, match="surplus_budget"):
        _cfg("algorithm.filter_groups.surplus_budget=-0.1")
