"""Tests for dapo_core.algo.dynamic_sampling: group filtering (docs/REFERENCE.md §6.1 step 8, §11 trap 1),
adaptive refill sizing, and the refill bounded by its expected surplus."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.algo.dynamic_sampling import (
    KeepRateEstimator,
    expected_surplus,
    filter_groups,
    next_gen_batch_size,
    surplus_bounded_size,
)
from dapo_core.config import ConfigError, load_config, typed
from flows.step_support import refill_size
from tests.helpers import simulate_refill


def _reference_loop(uids, values):
    """The reference rule written as a plain loop with np.std (population)."""
    groups: dict = {}
    for u, v in zip(uids, values, strict=True):
        groups.setdefault(u, []).append(v)
    kept = {u for u, vs in groups.items() if np.std(vs) > 0 or len(vs) == 1}
    return np.array([u in kept for u in uids], dtype=bool)


def test_filter_groups_example_order_preserved():
    uids = ["b", "a", "b", "c", "a", "d", "d"]
    values = [1.0, -1.0, -1.0, 1.0, -1.0, 0.5, -0.25]
    # b varies, a constant, c singleton, d varies
    assert filter_groups(uids, values).tolist() == [True, False, True, True, False, True, True]


def test_filter_groups_bool_metric_and_ints():
    assert filter_groups([1, 1, 2, 2], [True, False, True, True]).tolist() == [True, True, False, False]


def test_filter_groups_nan_and_empty_and_errors():
    assert filter_groups(["a", "a", "b"], [float("nan"), 1.0, float("nan")]).tolist() == [False, False, True]
    assert filter_groups([], []).shape == (0,)
    with pytest.raises(ValueError, match="uids has 2 entries but values has 1"):
        filter_groups(["a", "b"], [1.0])


def test_filter_follows_np_std_exactly_even_for_rounding_noise():
    # np.std([0.1]*3) is ~1.4e-17 > 0, so the reference keeps this group; we match it bit for bit
    assert np.std([0.1] * 3) > 0
    assert filter_groups(["a"] * 3, [0.1] * 3).all()
    assert not filter_groups(["a"] * 3, [0.5] * 3).any()  # exactly representable: std 0, dropped


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(-2, 2)), max_size=40))
def test_filter_groups_matches_reference_loop(pairs):
    uids = [f"u{u}" for u, _ in pairs]
    values = [float(v) for _, v in pairs]
    assert filter_groups(uids, values).tolist() == _reference_loop(uids, values).tolist()


def test_next_gen_batch_size_rules():
    assert next_gen_batch_size(512, None, base=1536) == 1536
    assert next_gen_batch_size(0, 0.5, base=1536) == 0
    assert next_gen_batch_size(-3, None, base=1536) == 0
    assert next_gen_batch_size(100, 0.4, base=1536) == math.ceil(100 / 0.4 * 1.2)
    assert next_gen_batch_size(100, 0.0, base=1536) == math.ceil(100 / 0.05 * 1.2)  # floored keep rate
    assert next_gen_batch_size(1, 1.0, base=1536, min_size=64) == 64
    assert next_gen_batch_size(500, 0.1, base=1536, max_size=2048) == 2048
    assert next_gen_batch_size(512, None, base=4096, max_size=2048) == 2048
    assert next_gen_batch_size(10, 0.5, base=8, safety=1.0) == 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"deficit_groups": 1.5, "keep_rate": 0.5, "base": 8}, "deficit_groups"),
        ({"deficit_groups": 4, "keep_rate": 1.5, "base": 8}, "keep_rate"),
        ({"deficit_groups": 4, "keep_rate": 0.5, "base": 0}, "base"),
        ({"deficit_groups": 4, "keep_rate": 0.5, "base": 8, "min_size": 10, "max_size": 5}, "max_size"),
        ({"deficit_groups": 4, "keep_rate": 0.5, "base": 8, "safety": 0.0}, "safety"),
    ],
)
def test_next_gen_batch_size_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        next_gen_batch_size(**kwargs)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2000), st.floats(0.0, 1.0), st.integers(1, 64), st.floats(1.0, 2.0))
def test_next_gen_batch_size_expected_fill(deficit, rate, min_size, safety):
    size = next_gen_batch_size(deficit, rate, base=1536, min_size=min_size, safety=safety)
    assert size >= min_size
    # the expected number of kept groups covers the deficit whenever the rate is above the floor
    if rate >= 0.05:
        assert size * rate >= deficit * safety - 1e-6 or size == min_size


def test_keep_rate_estimator():
    est = KeepRateEstimator(decay=1.0)
    assert est.rate is None
    est.update(30, 100)
    est.update(50, 100)
    assert est.rate == pytest.approx(0.4)
    prior = KeepRateEstimator(prior_rate=0.5, prior_weight=100, decay=1.0)
    assert prior.rate == 0.5
    prior.update(0, 100)
    assert prior.rate == pytest.approx(0.25)
    decayed = KeepRateEstimator(decay=0.5)
    decayed.update(100, 100)
    decayed.update(0, 100)
    assert decayed.rate == pytest.approx(50 / 150)
    clone = KeepRateEstimator(decay=0.5)
    clone.load_state_dict(decayed.state_dict())
    assert clone.rate == decayed.rate
    with pytest.raises(ValueError, match="num_kept_groups"):
        est.update(5, 4)
    with pytest.raises(ValueError, match="decay"):
        KeepRateEstimator(decay=0.0)


def test_adaptive_refill_reduces_simulated_surplus():
    """The refill simulation (`tests.helpers.simulate_refill`), at keep rate 0.7 and DAPO's
    512 / 1536 shape: adaptive sizing keeps under half the fixed batches' surplus with fewer prompts."""
    kw = {
        "steps": 40,
        "train_batch_size": 512,
        "gen_batch_size": 1536,
        "min_size": 64,
        "safety": 1.2,
        "seed": 0,
    }
    fixed = simulate_refill(0.7, False, **kw)
    adaptive = simulate_refill(0.7, True, **kw)
    assert adaptive["surplus_groups"] < fixed["surplus_groups"] / 2
    assert adaptive["prompts_per_step"] < fixed["prompts_per_step"]


# ----------------------------------------------------------------------------------------------------------
# Adaptive refill by expected surplus (`surplus_bounded_size`, `flows.run_setup.refill_size`).


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
