"""GPU checks of the packed (remove_padding) attention's CUDA path, `dapo_core.compute.varlen_attention`:
torch's flash `varlen_attn` over the rows' boundaries instead of an (N, N) mask.

(a) the kernel's output and gradients in bfloat16 equal the per-row causal SDPA reference (float32 on the same
    bfloat16 inputs) within bfloat16 error: rows of length 0, 1 and up to 1024, GQA 8/2 and 12/2, head dims
    32, 64 and 128;
(b) forward + backward over N = 16,384 packed tokens (8 heads) allocates far less than any N × N buffer: the
    peak above the inputs stays under N² bytes (256 MiB), where the dense packed mask transformers builds
    for SDPA would be N² booleans per call and N²·heads·2 bytes of scores (4 GiB) in a materialised
    attention;
(c) the torch engine's packed forward under bf16 autocast and gradient checkpointing runs the kernel (no SDPA
    mask built) and its log-probs and gradients are as close to the float32 padded forward as the bf16
    padded forward's.

Tolerances: bfloat16 keeps 8 mantissa bits (relative rounding 2^-9 ≈ 2e-3 per value); the flash kernel
accumulates in float32 and rounds its outputs and gradients to bfloat16 once, so its error against a float32
reference is a few 1e-3 relative to the largest value. (a) asserts the kernel's max error (relative to the
reference's largest magnitude) stays within 2× the per-row bf16 SDPA's own error plus 2e-3, and below 2e-2;
(c) compares each bf16 path to the float32 one with the same 2× + slack rule. Skipped without CUDA (no CPU dry
run: the CPU path is tests/unit/dapo_core/compute/test_varlen_attention.py) and where torch's kernel is
missing or the GPU predates compute capability 8.0.
"""

from __future__ import annotations

import pytest
import torch

import dapo_core.compute.varlen_attention as va
from dapo_core.compute.engines.train import make_train_engine

CUDA = torch.cuda.is_available()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False): the flash varlen kernel"
    ),
]

LENGTHS = [1, 37, 0, 300, 1024, 5, 513, 1]
"""Packed rows: one-token rows, an empty row, lengths that are not multiples of the kernel's blocks."""


@pytest.fixture(autouse=True)
def _kernel_available():
    if va.varlen_kernel() is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn with scale and window_size")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs compute capability 8.0+")


def _cu(lengths, device="cuda"):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu.to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| over max |b| (float32)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (4, 4, 128), (12, 2, 32)])
def test_kernel_matches_the_per_row_reference_in_bf16(heads, kv_heads, dim, record):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(LENGTHS)

    def leaf(h):
        return torch.randn(1, h, n, dim, device="cuda", generator=g).bfloat16().requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    assert va.kernel_supports(q, k, torch.bfloat16)
    cu, scale = _cu(LENGTHS), dim**-0.5
    out, _ = va.varlen_attention(
        torch.nn.Module(), q, k, v, None, scaling=scale, cu_seq_lens_q=cu, max_length_q=max(LENGTHS)
    )
    grad = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))

    bounds = cu.tolist()
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = va.segment_attention(q32, k32, v32, bounds, scale)
    want = (ref, *torch.autograd.grad(ref, (q32, k32, v32), grad.float()))
    qb, kb, vb = (x.detach().clone().requires_grad_() for x in (q, k, v))
    seg = va.segment_attention(qb, kb, vb, bounds, scale)
    bf16_sdpa = (seg, *torch.autograd.grad(seg, (qb, kb, vb), grad))

    gaps = {}
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, want, bf16_sdpa, strict=True):
        gaps[name] = {"kernel": _rel(a, b), "per_row_bf16_sdpa": _rel(c, b)}
    record(f"varlen_kernel_bf16_gap[{heads}/{kv_heads}x{dim}]", gaps)
    for name, gap in gaps.items():
        assert gap["kernel"] <= min(2 * gap["per_row_bf16_sdpa"] + 2e-3, 2e-2), (name, gap)


def test_no_n_by_n_buffer_at_16k_tokens(record):
    n, heads, kv_heads, dim = 16384, 8, 2, 64
    lengths = [n // 8] * 8
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(1)

    def leaf(h):
        return torch.randn(1, h, n, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    grad = torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = _cu(lengths)
    small = [x[:, :, :64].detach().requires_grad_() for x in (q, k, v)]  # warm-up: kernel setup not counted
    warm, _ = va.varlen_attention(torch.nn.Module(), *small, None, cu_seq_lens_q=_cu([64]), max_length_q=64)
    warm.sum().backward()
    del small, warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, _ = va.varlen_attention(
        torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(lengths)
    )
    out.backward(grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    record(
        "varlen_kernel_peak_16k",
        {"tokens": n, "heads": heads, "peak_above_inputs_MiB": peak / 2**20, "n_squared_MiB": n * n / 2**20},
    )
    assert peak < n * n, f"{peak / 2**20:.0f} MiB above the inputs: an (N, N) buffer? (N² bytes = 256 MiB)"
    assert q.grad is not None and k.grad is not None and torch.isfinite(q.grad.float()).all()


def test_engine_packed_forward_in_bf16_runs_the_kernel(bigger_dir, monkeypatch, record):
    import json

    vocab = int(json.loads((bigger_dir / "config.json").read_text())["vocab_size"])
    g = torch.Generator().manual_seed(2)
    rows, prompt, resp = 8, 64, 160
    ids = torch.randint(4, vocab, (rows, prompt + resp), generator=g)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : (13 * i) % (prompt - 1)] = 0
        mask[i, prompt + 1 + (37 * i) % resp :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    m = mask[:, prompt:].cuda().float()

    def run(compute_dtype, packed):
        eng = make_train_engine(
            "torch",
            bigger_dir,
            {"lr": 0.0},
            total_steps=1,
            grad_clip=1.0,
            device="cuda",
            gradient_checkpointing=True,
            compute_dtype=compute_dtype,
        )
        eng.train()
        lp, _ = eng.forward(ids, mask, pos, resp, remove_padding=packed)
        (lp.float() * m).sum().backward()
        grads = torch.cat([p.grad.flatten().float() for p in eng.model.parameters() if p.grad is not None])
        out = (lp.detach().float() * m, grads)
        eng.close()
        return out

    ref_lp, ref_g = run(None, False)
    pad_lp, pad_g = run(torch.bfloat16, False)
    calls, masks = [], []
    kernel = va._kernel_attention
    monkeypatch.setattr(va, "_kernel_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(va, "sdpa_mask", lambda *a, **k: masks.append(1))
    pk_lp, pk_g = run(torch.bfloat16, True)
    assert calls and not masks  # the kernel ran (forward and the checkpointed re-run), no mask was built
    gaps = {
        "logp_padded_bf16": float((pad_lp - ref_lp).abs().max()),
        "logp_packed_bf16": float((pk_lp - ref_lp).abs().max()),
        "grad_padded_bf16": float((pad_g - ref_g).norm() / ref_g.norm()),
        "grad_packed_bf16": float((pk_g - ref_g).norm() / ref_g.norm()),
    }
    record("varlen_engine_bf16_vs_fp32", gaps)
    assert gaps["logp_packed_bf16"] <= 2 * gaps["logp_padded_bf16"] + 1e-2, gaps
    assert gaps["grad_packed_bf16"] <= 2 * gaps["grad_padded_bf16"] + 1e-2, gaps
