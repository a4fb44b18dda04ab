"""`dapo_core.compute.varlen_attention` on CPU: packed attention without an (N, N) mask.

- The per-row attention equals SDPA under the dense block-diagonal causal mask (output and gradients; rows of
  length 0 and 1, GQA heads), float64.
- A packed model forward equals the padded forward's response log-probs (float32 / float64) and, under
  gradient checkpointing (each layer re-run in backward, after the forward returned), its gradients; no SDPA
  mask is built inside `packed_attention`.
- Outside packed forwards the switched model is SDPA: the grouped shared-prompt forward gives the same numbers
  before and after the switch.
The CUDA kernel path is tested in tests/gpu/test_gpu_varlen_attention.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dapo_core.compute.varlen_attention as va
from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.microbatch import pack_rows
from dapo_core.compute.models import build_tiny_model
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

TINY = tiny_model_cfg(hidden_size=32, intermediate_size=64, max_position_embeddings=128)
"""Two layers, 2 query heads over 1 KV head (GQA), head dim 32."""
OPTIM = {"lr": 1e-2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("varlen"), TINY, seed=3)


def dense_reference(q, k, v, lengths, scale):
    """SDPA over the whole packed sequence under a block-diagonal causal mask, KV heads repeated."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = int(seg.numel())
    mask = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale)
    return out.transpose(1, 2)


def packed_qkv(lengths, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    make = lambda h: torch.randn(1, h, n, dim, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def cu_of(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu


@pytest.mark.parametrize("lengths", [[5, 1, 0, 9, 3], [1], [7, 7], [1, 1, 1, 12]])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 3), (4, 1)])
def test_varlen_attention_and_its_gradients_equal_dense_masked_sdpa(lengths, heads, kv_heads):
    q, k, v = packed_qkv(lengths, heads, kv_heads)
    cu = cu_of(lengths)
    kwargs = {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }
    out, weights = va.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, **kwargs)
    ref = dense_reference(q, k, v, lengths, 0.3)
    assert weights is None and out.shape == (1, sum(lengths), heads, q.shape[-1])
    assert float((out - ref).detach().abs().max()) < 1e-12
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) < 1e-12


def test_without_packing_kwargs_it_is_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = packed_qkv([6, 4])
    mask = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    mask[..., 2:, :2] = False
    module = torch.nn.Module()
    module.num_key_value_groups = 2  # type: ignore[assignment]
    got, _ = va.varlen_attention(module, q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert torch.equal(got, want)


def test_packed_call_refuses_dropout_a_mask_and_a_batch():
    q, k, v = packed_qkv([3, 2])
    kw = {"cu_seq_lens_q": cu_of([3, 2]), "max_length_q": 3}
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="dropout"):
        va.varlen_attention(module, q, k, v, None, dropout=0.1, **kw)
    with pytest.raises(ValueError, match="no mask"):
        va.varlen_attention(module, q, k, v, torch.ones(1, 1, 5, 5, dtype=torch.bool), **kw)
    with pytest.raises(ValueError, match="one"):
        va.varlen_attention(module, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v, None, **kw)
    with pytest.raises(ValueError, match="runs from"):
        va.varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu_of([3, 1]), max_length_q=3)


def test_pack_rows_gives_row_boundaries_with_empty_rows():
    ids = torch.arange(1, 25).reshape(4, 6)
    mask = torch.tensor(
        [[0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]], dtype=torch.long
    )
    packed = pack_rows(ids, mask, 2)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 4, 4, 10, 12]
    assert packed.max_seqlen == 6
    for b in range(4):
        s, e = packed.cu_seqlens[b : b + 2].tolist()
        assert packed.input_ids[0, s:e].tolist() == ids[b][mask[b].bool()].tolist()
        assert packed.position_ids[0, s:e].tolist() == list(range(e - s))


def ragged_batch(n=6, prompt_len=6, resp_len=10, seed=1):
    """Left-padded prompts (3..6 tokens), right-padded responses (1..10 tokens); a one-token row included."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (n, prompt_len + resp_len), generator=g)
    mask = torch.ones_like(ids)
    for i in range(n):
        mask[i, : i % 4] = 0
        mask[i, prompt_len + 1 + (7 * i) % resp_len :] = 0
    mask[n - 1, : prompt_len - 1] = 0  # a one-token prompt
    return ids.masked_fill(mask == 0, 0), mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.float64, 1e-10)])
def test_packed_forward_equals_the_padded_one_and_builds_no_mask(tiny_dir, monkeypatch, dtype, tol):
    ids, mask, pos = ragged_batch()
    eng = make_train_engine("torch", tiny_dir, OPTIM, total_steps=1, grad_clip=1.0, dtype=dtype)
    eng.eval()
    lp, ent = eng.forward(ids, mask, pos, 10, calculate_entropy=True)
    masks_built = []
    monkeypatch.setattr(va, "sdpa_mask", lambda *a, **k: masks_built.append(1))
    lp_p, ent_p = eng.forward(ids, mask, pos, 10, calculate_entropy=True, remove_padding=True)
    assert eng.model.config._attn_implementation == va.VARLEN_ATTENTION
    assert masks_built == []
    m = mask[:, 6:].bool()
    assert float((lp - lp_p)[m].abs().max()) < tol
    assert ent is not None and ent_p is not None and float((ent - ent_p)[m].abs().max()) < tol


def test_packed_gradients_under_checkpointing_equal_the_padded_ones(tiny_dir):
    """Checkpointing re-runs every layer in backward, outside `packed_attention`: the kwargs must carry it."""
    ids, mask, pos = ragged_batch(seed=2)
    eng = make_train_engine(
        "torch",
        tiny_dir,
        OPTIM,
        total_steps=1,
        grad_clip=1.0,
        dtype=torch.float64,
        gradient_checkpointing=True,
    )
    eng.train()
    m = mask[:, 6:].to(torch.float64)
    grads = []
    for packed in (False, True):
        lp, _ = eng.forward(ids, mask, pos, 10, remove_padding=packed)
        (lp * m).sum().backward()
        grads.append({k: p.grad.clone() for k, p in eng.model.named_parameters() if p.grad is not None})
        eng.model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    assert max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0]) < 1e-10


def test_other_forwards_are_unchanged_after_the_switch(tiny_dir):
    ids, mask, pos = ragged_batch(n=4, seed=3)
    ids[1], mask[1], pos[1] = ids[0], mask[0], pos[0]  # rows 0 and 1 share their prompt (and response)
    eng = make_train_engine("torch", tiny_dir, OPTIM, total_steps=1, grad_clip=1.0, dtype=torch.float32)
    eng.eval()
    before = [eng.forward(ids, mask, pos, 10, share_prompt=s)[0] for s in (False, True)]
    eng.forward(ids, mask, pos, 10, remove_padding=True)
    assert eng.model.config._attn_implementation == va.VARLEN_ATTENTION
    assert eng._takes_4d_masks()
    after = [eng.forward(ids, mask, pos, 10, share_prompt=s)[0] for s in (False, True)]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_eager_models_keep_their_mask(tiny_dir):
    from dapo_core.compute.models import load_model

    model = load_model(tiny_dir, attn_implementation="eager")
    with va.packed_attention(model, cu_of([3, 0, 2]), 3, "cpu") as kwargs:
        assert kwargs == {}
    assert model.config._attn_implementation == "eager"
    sdpa = load_model(tiny_dir)
    with va.packed_attention(sdpa, cu_of([3, 0, 2]), 3, "cpu") as kwargs:
        assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5]  # the empty row dropped
        assert kwargs["max_length_q"] == 3 and va.varlen_mask() is None
    assert va.varlen_mask(batch_size=1, q_length=2, kv_length=2, allow_is_causal_skip=False) is not None
