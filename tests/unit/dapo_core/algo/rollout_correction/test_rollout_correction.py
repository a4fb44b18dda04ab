"""Rollout correction (IS weights, rejection sampling, diagnostics, presets): docs/REFERENCE.md §5, §10."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.algo.rollout_correction import (
    SUPPORTED_ROLLOUT_RS_OPTIONS,
    RolloutCorrection,
    apply_rollout_correction,
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    parse_is_threshold,
)

torch.set_num_threads(1)


def _batch(seed=0, b=4, length=6, dtype=torch.float32, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, length, generator=g, dtype=dtype) * 2
    rollout = old + torch.randn(b, length, generator=g, dtype=dtype) * scale
    mask = torch.ones(b, length)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return old, rollout, mask


# -------------------------------------------------------------------------------------------- worked examples


def test_token_k1_rejects_row_with_log_ratio_minus_one_keeps_weights():
    old = torch.tensor([[-1.0], [0.5]])
    rollout = torch.zeros(2, 1)
    mask = torch.ones(2, 1)
    w, new_mask, m = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old,
        rollout_log_prob=rollout,
        response_mask=mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_2.0",
    )
    assert new_mask.tolist() == [[0.0], [1.0]]
    # RS acts only through the mask: the weights are not zeroed
    torch.testing.assert_close(w, torch.tensor([[math.exp(-1.0)], [math.exp(0.5)]]))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


def test_icepop_metrics_worked_example():
    raw = torch.tensor([[0.4, 0.8, 6.0]])
    applied = torch.tensor([[0.0, 0.8, 0.0]])
    mask = torch.ones(1, 3)
    m = compute_is_metrics(
        rollout_is_weights=applied,
        raw_rollout_is_weights=raw,
        log_ratio_for_metrics=raw.log(),
        response_mask=mask,
        rollout_is="token",
        rollout_is_threshold="0.5_5.0",
    )
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 3)
    assert m["rollout_is_std"] == pytest.approx(0.3771236, abs=1e-6)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / 3, abs=1e-6)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)


def test_icepop_weights_end_to_end():
    old = torch.tensor([[-0.5, 2.0, -0.2]])  # raw ratios 0.607, 7.39 (out of [0.5, 5]), 0.819
    w, mask, m = compute_rollout_correction_and_rejection_mask(
        old, torch.zeros(1, 3), torch.ones(1, 3), rollout_is="token", rollout_is_threshold="0.5_5.0"
    )
    torch.testing.assert_close(w, torch.tensor([[0.60653067, 0.0, 0.81873075]]))
    assert mask.tolist() == [[1.0, 1.0, 1.0]]  # IcePop leaves the mask alone
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(1 / 3)


def test_seq_fraction_high_uses_raw_weights():
    raw = torch.tensor([[3.0, 3.0], [1.0, 1.0]])
    applied = torch.clamp(raw, max=2.0)
    m = compute_is_metrics(
        applied, raw, raw.log(), torch.ones(2, 2), rollout_is="token", rollout_is_threshold=2.0
    )
    assert m["rollout_is_seq_fraction_high"] == pytest.approx(0.5)
    assert m["rollout_is_seq_max"] == pytest.approx(2.0)


def test_threshold_bool_is_type_error():
    old, rollout, mask = _batch()
    with pytest.raises(TypeError, match="not a boolean"):
        compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, rollout_is="token", rollout_is_threshold=True
        )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [(2.0, (None, 2.0, False)), ("3", (None, 3.0, False)), ("0.5_5.0", (0.5, 5.0, True))],
)
def test_parse_is_threshold(spec, expected):
    assert parse_is_threshold(spec) == expected


@pytest.mark.parametrize("bad", ["", "0_2", "3_2", "-1", "a_b", "1_2_3"])
def test_parse_is_threshold_rejects(bad):
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        parse_is_threshold(bad)


def test_disabled_returns_none_and_unchanged_mask_but_kl():
    old, rollout, mask = _batch()
    w, new_mask, m = compute_rollout_correction_and_rejection_mask(old, rollout, mask)
    assert w is None
    assert new_mask is mask
    assert "rollout_corr/kl" in m and "rollout_corr/training_ppl" in m
    assert not any("rollout_is" in k or "rollout_rs" in k for k in m)


@pytest.mark.parametrize("option", SUPPORTED_ROLLOUT_RS_OPTIONS)
def test_every_rs_option_emits_mean(option):
    old, rollout, mask = _batch(seed=1)
    thr = "0.5_2.0" if option.endswith("k1") else 0.5
    _, new_mask, m = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs=option, rollout_rs_threshold=thr
    )
    assert f"rollout_corr/rollout_rs_{option}_mean" in m
    assert f"rollout_corr/rollout_rs_{option}_masked_fraction" in m
    assert bool(((new_mask != 0) <= (mask != 0)).all())


def test_chained_options_and_per_option_thresholds():
    old = torch.tensor([[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.1, -0.1, 0.0]])
    rollout = torch.zeros(4, 3)
    mask = torch.ones(4, 3)
    _, new_mask, m = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.4_1.8,3.0"
    )
    # row 1: token k1 = 1.0 > log 1.8 → only that token rejected; row 2: k3(3) = e^3-4 ≈ 16 > 3 → whole row
    assert new_mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 0], [1, 1, 1]]
    assert "rollout_corr/rollout_rs_token_k1_mean" in m and "rollout_corr/rollout_rs_seq_max_k3_mean" in m
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 12)


def test_k1_asymmetric_bounds_constrain_rollout_over_train():
    # keep iff log(0.5) <= -log_ratio <= log(4)  ⇔  -log 4 <= log_ratio <= log 2
    old = torch.tensor([[1.0], [-1.2], [-1.5]])
    new_mask, _ = compute_rollout_rejection_mask(old, torch.ones(3, 1), "token_k1", "0.5_4.0")
    assert new_mask.tolist() == [[0.0], [1.0], [0.0]]


def test_rs_threshold_errors():
    old, rollout, mask = _batch()
    lr = old - rollout
    with pytest.raises(ValueError, match="rollout_rs_threshold is None"):
        compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_rs="token_k1")
    with pytest.raises(ValueError, match="single upper bound"):
        compute_rollout_rejection_mask(lr, mask, "seq_mean_k3", "0.1_0.2")
    with pytest.raises(ValueError, match="one per option"):
        compute_rollout_rejection_mask(lr, mask, "token_k1,seq_max_k3,token_k2", "2.0,3.0")
    with pytest.raises(ValueError, match="did you mean 'seq_mean_k"):
        compute_rollout_rejection_mask(lr, mask, "seq_mean_k", 2.0)
    with pytest.raises(TypeError, match="not a boolean"):
        compute_rollout_rejection_mask(lr, mask, "token_k1", True)


def test_duplicate_options_dropped():
    old, rollout, mask = _batch()
    m1, _ = compute_rollout_rejection_mask(old - rollout, mask, "token_k2,token_k2", 0.01)
    m2, _ = compute_rollout_rejection_mask(old - rollout, mask, "token_k2", 0.01)
    assert torch.equal(m1, m2)


def test_empty_mask_and_shape_errors():
    old, rollout, mask = _batch()
    with pytest.raises(ValueError, match="no valid token"):
        compute_rollout_correction_and_rejection_mask(
            old, rollout, torch.zeros_like(mask), rollout_is="token"
        )
    with pytest.raises(ValueError, match="shape"):
        compute_rollout_correction_and_rejection_mask(old, rollout[:, :3], mask)


def test_sequence_weights_constant_per_row_and_capped():
    old, rollout, mask = _batch(seed=3, scale=1.0)
    w, _, m = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0
    )
    seq_lr = ((old - rollout) * mask).sum(-1)
    expected = torch.clamp(torch.exp(seq_lr), max=2.0)
    for i in range(old.shape[0]):
        row = w[i][mask[i].bool()]
        torch.testing.assert_close(row, expected[i].expand_as(row))
        assert bool((w[i][~mask[i].bool()] == 0).all())
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(
        math.exp(min(seq_lr.max().item(), 20.0)), rel=1e-5
    )


def test_batch_normalize_token_and_sequence():
    old, rollout, mask = _batch(seed=4)
    lr = old - rollout
    w, m = compute_rollout_correction_weights(lr, mask, "token", 5.0, rollout_is_batch_normalize=True)
    assert ((w * mask).sum() / mask.sum()).item() == pytest.approx(1.0, rel=1e-5)
    assert m["rollout_is_batch_norm_factor"] > 0
    ws, _ = compute_rollout_correction_weights(lr, mask, "sequence", 5.0, rollout_is_batch_normalize=True)
    per_seq = (ws * mask).sum(-1) / mask.sum(-1)
    assert per_seq.mean().item() == pytest.approx(1.0, rel=1e-5)


def test_float64_preserved_and_detached():
    old, rollout, mask = _batch(dtype=torch.float64)
    old.requires_grad_(True)
    w, _, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_is="token")
    assert w.dtype == torch.float64 and not w.requires_grad


def test_offpolicy_metrics_on_policy_are_zero():
    old, _, mask = _batch()
    m = compute_offpolicy_metrics(old_log_prob=old, rollout_log_prob=old.clone(), response_mask=mask)
    for key in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert m[key] == pytest.approx(0.0, abs=1e-6), key
    assert m["ppl_ratio"] == pytest.approx(1.0)
    assert m["training_ppl"] == pytest.approx(m["rollout_ppl"])
    only = compute_offpolicy_metrics(old, None, mask)
    assert set(only) == {"training_ppl", "training_log_ppl"}


def test_offpolicy_metrics_worked_example():
    old = torch.tensor([[-1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -0.5]])  # lr = [0.5, -0.5]
    m = compute_offpolicy_metrics(old, rollout, torch.ones(1, 2))
    assert m["kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["k3_kl"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 2, rel=1e-6)
    assert m["chi2_token"] == pytest.approx((math.exp(1.0) + math.exp(-1.0)) / 2 - 1, rel=1e-6)
    assert m["chi2_seq"] == pytest.approx(0.0, abs=1e-6)
    assert m["training_ppl"] == pytest.approx(math.e, rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-30, 30, allow_nan=False), min_size=6, max_size=6),
    st.lists(st.booleans(), min_size=6, max_size=6),
    st.sampled_from(["token", "sequence"]),
    st.floats(1.01, 10.0),
)
def test_property_tis_weights_capped_and_masked(lrs, mbits, level, cap):
    lr = torch.tensor(lrs, dtype=torch.float64).reshape(2, 3)
    mask = torch.tensor(mbits, dtype=torch.float64).reshape(2, 3)
    mask[0, 0] = 1.0
    w, m = compute_rollout_correction_weights(lr, mask, level, cap)
    assert bool((w <= cap + 1e-12).all()) and bool((w >= 0).all())
    assert bool((w[mask == 0] == 0).all())
    assert all(math.isfinite(v) for v in m.values())
    new_mask, _ = compute_rollout_rejection_mask(lr, mask, "token_k1,seq_mean_k3", "0.5_2.0,0.1")
    assert bool((new_mask <= mask).all())


# ----------------------------------------------------------------------------------------- config and presets

PRESETS = {
    "decoupled_token_is": ("token", 2.0, None, None, False, "ppo_clip"),
    "decoupled_seq_is": ("sequence", 2.0, None, None, False, "ppo_clip"),
    "decoupled_token_icepop": ("token", "0.5_5.0", None, None, False, "ppo_clip"),
    "decoupled_seq_is_rs": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0", False, "ppo_clip"),
    "decoupled_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "bypass_ppo_clip": (None, 2.0, None, None, True, "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "ppo_clip"),
    "bypass_ppo_clip_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, True, "ppo_clip"),
    "bypass_pg_is": ("sequence", 2.0, None, None, True, "reinforce"),
    "bypass_pg_token_icepop": ("token", "0.5_5.0", None, None, True, "reinforce"),
    "bypass_pg_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "disabled": (None, 2.0, None, None, False, "ppo_clip"),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_exact_values_and_round_trip(name):
    cfg = RolloutCorrection.preset(name)
    got = (
        cfg.rollout_is,
        cfg.rollout_is_threshold,
        cfg.rollout_rs,
        cfg.rollout_rs_threshold,
        cfg.bypass_mode,
        cfg.loss_type,
    )
    assert got == PRESETS[name]
    assert RolloutCorrection.from_dict(cfg.to_dict()) == cfg
    assert RolloutCorrection.from_dict({"preset": name, "rollout_is": "token"}) == cfg  # the preset wins


def test_config_defaults_and_preset_arguments():
    assert RolloutCorrection().rollout_is == "sequence"  # dataclass default, unlike the YAML (null)
    assert (
        RolloutCorrection.preset("decoupled_geo_rs_seq_tis", rollout_rs_threshold=1.001).rollout_rs_threshold
        == 1.001
    )
    icepop = RolloutCorrection.preset("decoupled_token_icepop", rollout_is_threshold="0.25_4.0")
    assert icepop.rollout_is_threshold == "0.25_4.0" and icepop.rollout_is == "token"
    assert RolloutCorrection.from_dict(None) == RolloutCorrection.disabled()
    with pytest.raises(ValueError, match="did you mean 'bypass_pg_is'"):
        RolloutCorrection.preset("bypas_pg_is")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="did you mean 'rollout_rs_threshold'"):
        RolloutCorrection.from_dict({"rollout_rs_treshold": 2.0})
    with pytest.raises(ValueError, match="loss_type"):
        RolloutCorrection(loss_type="ppo")
    with pytest.raises(ValueError, match="rollout_is="):
        RolloutCorrection(rollout_is="tokens")
    with pytest.raises(TypeError, match="not a boolean"):
        RolloutCorrection(rollout_is_threshold=True)
    with pytest.raises(ValueError, match="rollout_rs_threshold is None"):
        RolloutCorrection(rollout_rs="seq_mean_k1")


def test_apply_rollout_correction_decoupled_and_bypass():
    old, rollout, mask = _batch(seed=5, scale=0.5)
    cfg = RolloutCorrection.preset("decoupled_geo_rs_token_tis")
    w, new_mask, m = apply_rollout_correction(old, rollout, mask, cfg)
    w2, mask2, m2 = compute_rollout_correction_and_rejection_mask(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001",
    )
    assert torch.equal(w, w2) and torch.equal(new_mask, mask2) and m == m2
    wb, mb, mtb = apply_rollout_correction(
        old, rollout, mask, RolloutCorrection.preset("bypass_pg_is").to_dict()
    )
    assert wb is None and mb is mask and "rollout_corr/kl" in mtb
    wd, md, _ = apply_rollout_correction(old, rollout, mask, None)
    assert wd is None and md is mask


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_nonfinite_padding_gives_zero_weights_and_finite_loss_gradient(level):
    # padding may hold NaN/inf log-probs (e.g. −inf − −inf); the weight there must be 0, not NaN, otherwise
    # loss·w puts NaN into the gradient even though the forward loss masks the position out
    from dapo_core.algo.losses import PolicyLossParams, get_policy_loss

    lr = torch.tensor([[0.1, float("nan"), float("inf")]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    w, m = compute_rollout_correction_weights(lr, mask, level, 2.0)
    assert w.tolist() == [[pytest.approx(math.exp(0.1)), 0.0, 0.0]]
    assert all(math.isfinite(v) for v in m.values())
    log_prob = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    loss, _ = get_policy_loss("vanilla")(
        torch.zeros(1, 3, dtype=torch.float64),
        log_prob,
        adv,
        mask,
        params=PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28),
        rollout_is_weights=w,
    )
    loss.backward()
    assert torch.isfinite(log_prob.grad).all()
    assert log_prob.grad[0, 0].item() == pytest.approx(-math.exp(0.1))  # d(−A·w·r)/dlogp at ratio 1
