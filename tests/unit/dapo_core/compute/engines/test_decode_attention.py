"""The rollout engine's decode attention: SDPA's numbers for one-token steps, SDPA itself for the rest, and
the shared-prompt cache (each distinct prompt's keys and values once for all of its rows)."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dapo_core.compute.engines import hf_rollout
from dapo_core.compute.engines.decode_attention import (
    DECODE_ATTENTION,
    SharedPrefixCache,
    decode_attention,
    shared_prefix_cache,
)
from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.models import build_tiny_model, load_tokenizer
from tests.helpers import tiny_model_cfg

B, HEADS, KV_HEADS, L, D = 6, 4, 2, 9, 8


def _module() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        num_key_value_groups=HEADS // KV_HEADS, is_causal=True, training=False, layer_idx=0
    )


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


def _shared_case(row_prompt: list[int], seed: int = 0, new: int = 5):
    """Prompts of P = 7 positions (prompt 1 left-padded by 3), rows continuing `row_prompt`, `new` generated
    positions each: the shared cache, and the same keys / values / mask laid out per row."""
    from transformers import Qwen2Config

    g = torch.Generator().manual_seed(seed)
    u, p, b = max(row_prompt) + 1, 7, len(row_prompt)
    config = Qwen2Config(
        hidden_size=HEADS * D,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=D,
        num_hidden_layers=1,
        vocab_size=16,
    )
    cache = shared_prefix_cache(config, capacity=new + 2)
    assert isinstance(cache, SharedPrefixCache)
    pk, pv = torch.randn(u, KV_HEADS, p, D, generator=g), torch.randn(u, KV_HEADS, p, D, generator=g)
    prompt_mask = torch.ones(u, p, dtype=torch.long)
    if u > 1:
        prompt_mask[1, :3] = 0
    cache.layers[0].update(pk, pv)
    rows = torch.as_tensor(row_prompt)
    cache.share(rows, prompt_mask)
    sk, sv = torch.randn(b, KV_HEADS, new, D, generator=g), torch.randn(b, KV_HEADS, new, D, generator=g)
    k, v = cache.layers[0].update(sk, sv)
    assert cache.get_seq_length() == p + new
    q = torch.randn(b, HEADS, 1, D, generator=g)
    full_k, full_v = torch.cat([pk[rows], sk], dim=2), torch.cat([pv[rows], sv], dim=2)
    keep = torch.cat([prompt_mask[rows], torch.ones(b, new, dtype=torch.long)], dim=1).bool()
    return cache, q, k, v, full_k, full_v, keep[:, None, None, :]


@pytest.mark.parametrize(
    ("rows", "kept_rows", "stacked_by_reshape"),
    [([0, 1, 0, 2, 2, 0], [1, 3, 4], False), ([0, 0, 1, 1, 2, 2], [2, 3, 4], True)],
    ids=["uneven-groups", "prompt-by-prompt"],
)
def test_shared_prompt_step_equals_the_per_row_cache(rows, kept_rows, stacked_by_reshape):
    """Uneven groups (3, 1 and 2 rows, not contiguous) or rows prompt by prompt (stacked by a reshape, no
    slots), a left-padded prompt: the step over the shared cache gives each row's full-cache attention to
    float rounding; after a compaction that drops prompt 0's rows the unused prompt leaves the cache and the
    remaining rows still agree."""
    cache, q, k, v, full_k, full_v, keep = _shared_case(rows)
    assert (cache.slots()[0] is None) == stacked_by_reshape
    ours, _ = decode_attention(_module(), q, k, v, None, scaling=D**-0.5, shared_prefix=cache)
    ref, _ = decode_attention(_module(), q, full_k, full_v, keep, scaling=D**-0.5)
    ref_sdpa, _ = sdpa_attention_forward(_module(), q, full_k, full_v, keep, scaling=D**-0.5)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(ours, ref_sdpa, rtol=0, atol=2e-6)
    kept = torch.tensor(kept_rows)
    cache.batch_select_indices(kept)
    used = sorted({rows[i] for i in kept_rows})
    assert cache.layers[0].prefix_keys.shape[0] == len(used) < 3
    assert cache.row_prompt.tolist() == [used.index(rows[i]) for i in kept_rows]
    layer = cache.layers[0]
    ours, _ = decode_attention(
        _module(), q[kept], layer.keys, layer.values, None, scaling=D**-0.5, shared_prefix=cache
    )
    ref, _ = decode_attention(_module(), q[kept], full_k[kept], full_v[kept], keep[kept], scaling=D**-0.5)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)


def test_shared_prompt_step_row_does_not_depend_on_its_neighbours():
    """A row alone with its prompt's cache gives what it gives among other rows, to float rounding: the
    prompt part is a matmul over the group's stacked rows, and the CPU GEMM's rounding depends on the row
    count (as in the linear layers, whose rows the engine's row-independence tests already cover)."""
    rows = [0, 0, 1, 0, 1, 1, 1]
    cache, q, k, v, *_ = _shared_case(rows, seed=5)
    whole, _ = decode_attention(_module(), q, k, v, None, shared_prefix=cache)
    for r, prompt in enumerate(rows):
        single, *_ = _shared_case(rows, seed=5)
        single.batch_select_indices(torch.tensor([r]))
        assert single.row_prompt.tolist() == [0] and single.layers[0].prefix_keys.shape[0] == 1
        layer = single.layers[0]
        out, _ = decode_attention(
            _module(), q[r : r + 1], layer.keys, layer.values, None, shared_prefix=single
        )
        torch.testing.assert_close(out[0], whole[r], rtol=0, atol=2e-6, msg=f"row {r} (prompt {prompt})")


def test_shared_prefix_refuses_steps_it_cannot_serve():
    cache, q, k, v, *_ = _shared_case([0, 1])
    with pytest.raises(ValueError, match="shared_prefix"):
        decode_attention(_module(), q.expand(-1, -1, 2, -1), k, v, None, shared_prefix=cache)


def test_engine_keeps_each_prompt_once_and_drops_finished_prompts(tmp_path, monkeypatch):
    """The engine's default cache: after the prefill it holds one copy per distinct prompt, not per row; rows
    that end leave it in batches, prompts whose rows all ended too. Tokens equal the per-row cache's (decode
    attention with the prompt cache copied to every row) to float rounding."""
    path = build_tiny_model(tmp_path / "tiny", tiny_model_cfg(hidden_size=32, intermediate_size=64), seed=0)
    tok = load_tokenizer(path)
    texts = ["1+1=", "What is 12*3?", "x", "7", "ab", "9-4=", "Hi", "2*8="]
    prompts = [p for t in texts for p in [tok.encode(t)] * 2]
    seeds = list(range(len(prompts)))
    params = SamplingParams(max_new_tokens=150, temperature=1.3)
    made: list[SharedPrefixCache] = []
    prefix_rows: list[int] = []
    select, share = SharedPrefixCache.batch_select_indices, SharedPrefixCache.share

    def shared(self, row_prompt, prompt_mask):
        share(self, row_prompt, prompt_mask)
        prefix_rows.append(self.layers[0].prefix_keys.shape[0])

    def counted(self, indices):
        select(self, indices)
        prefix_rows.append(self.layers[0].prefix_keys.shape[0])

    def capture(config, capacity):
        made.append(SharedPrefixCache(config, capacity))
        return made[-1]

    monkeypatch.setattr(SharedPrefixCache, "batch_select_indices", counted)
    monkeypatch.setattr(SharedPrefixCache, "share", shared)
    monkeypatch.setattr(hf_rollout, "shared_prefix_cache", capture)
    engine = HFRolloutEngine(path, progress=False, compact_fraction=0.0)  # compact at every finished row
    ours = engine.generate(prompts, params, seeds)
    assert len(made) == 1 and made[0].layers[0].prefix_keys is not None
    # the prefill's cache: one row per distinct prompt; then whole prompts left as their rows ended
    assert prefix_rows[0] == len(texts) and len(prefix_rows) > 1 and prefix_rows[-1] < len(texts)
    monkeypatch.setattr(hf_rollout, "shared_prefix_cache", lambda config, capacity: None)
    per_row = engine.generate(prompts, params, seeds)
    assert [c.token_ids for c in ours] == [c.token_ids for c in per_row]
    assert len({len(c.token_ids) for c in ours}) > 1
    for a, b in zip(ours, per_row, strict=True):
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 1e-5
