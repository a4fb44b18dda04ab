"""The rollout engine's decode attention: SDPA's numbers for one-token steps, SDPA itself for the rest."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dapo_core.compute.engines.decode_attention import DECODE_ATTENTION, decode_attention
from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.models import build_tiny_model, load_tokenizer
from tests.helpers import tiny_model_cfg

B, HEADS, KV_HEADS, L, D = 6, 4, 2, 9, 8


def _module() -> types.SimpleNamespace:
    return types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, training=False)


def _inputs(q_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, q_len, D, generator=g)
    k = torch.randn(B, KV_HEADS, L, D, generator=g)
    v = torch.randn(B, KV_HEADS, L, D, generator=g)
    keep = torch.ones(B, 1, q_len, L, dtype=torch.bool)
    keep[1, :, :, :3] = False  # a left-padded row
    keep[4, :, :, :5] = False
    return q, k, v, keep


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_one_token_step_equals_sdpa(mask_kind):
    q, k, v, keep = _inputs(1)
    mask = {
        "bool": keep,
        "additive": torch.zeros(keep.shape).masked_fill(~keep, float("-inf")),
        "none": None,
    }[mask_kind]
    ours, _ = decode_attention(_module(), q, k, v, mask, scaling=D**-0.5)
    ref, _ = sdpa_attention_forward(_module(), q, k, v, mask, scaling=D**-0.5)
    assert ours.shape == ref.shape == (B, 1, HEADS, D)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)


def test_a_row_does_not_depend_on_its_neighbours():
    """Bitwise: each row alone gives exactly what it gives inside the batch (what a resume relies on)."""
    q, k, v, keep = _inputs(1, seed=3)
    whole, _ = decode_attention(_module(), q, k, v, keep)
    for r in range(B):
        alone, _ = decode_attention(_module(), q[r : r + 1], k[r : r + 1], v[r : r + 1], keep[r : r + 1])
        assert torch.equal(alone[0], whole[r])


def test_prefill_and_gradients_go_to_sdpa_unchanged():
    q, k, v, keep = _inputs(4)
    causal = keep & torch.ones(4, L, dtype=torch.bool).tril(diagonal=L - 4)
    ours, _ = decode_attention(_module(), q, k, v, causal)
    ref, _ = sdpa_attention_forward(_module(), q, k, v, causal)
    assert torch.equal(ours, ref)
    q1, k1, v1, keep1 = _inputs(1)
    q1.requires_grad_(True)
    ours, _ = decode_attention(_module(), q1, k1, v1, keep1)
    ref, _ = sdpa_attention_forward(_module(), q1, k1, v1, keep1)
    assert torch.equal(ours, ref) and ours.requires_grad


def test_engine_samples_the_same_tokens_with_and_without_it(tmp_path):
    """The engine's default runs the decode steps here; switched off it runs SDPA. Same seeds, same tokens
    (a token could only differ if two candidates tied to within ~1e-6), log-probs within float rounding."""
    path = build_tiny_model(tmp_path / "tiny", tiny_model_cfg(hidden_size=32, intermediate_size=64), seed=0)
    tok = load_tokenizer(path)
    prompts = [p for t in ["1+1=", "What is 12*3?", "x"] for p in [tok.encode(t)] * 4]
    seeds = list(range(len(prompts)))
    params = SamplingParams(max_new_tokens=24, temperature=1.2)
    fast = HFRolloutEngine(path, progress=False)
    plain = HFRolloutEngine(path, progress=False, decode_attention=False)
    assert fast.model.config._attn_implementation == DECODE_ATTENTION
    assert plain.model.config._attn_implementation == "sdpa"
    a, b = fast.generate(prompts, params, seeds), plain.generate(prompts, params, seeds)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert (
        max(
            abs(x - y)
            for c, d in zip(a, b, strict=True)
            for x, y in zip(c.log_probs, d.log_probs, strict=True)
        )
        < 1e-5
    )
