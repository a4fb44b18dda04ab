"""Blocked log-probs and entropy (`dapo_core.compute.logits`) equal the plain computation, values and
gradients, and the engine functions keep the plain path below the threshold."""

from __future__ import annotations

import pytest
import torch

from dapo_core.compute import logits as L
from dapo_core.compute.engines.train import entropy_from_logits, response_log_probs


def _plain(z: torch.Tensor, y: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.double() if z.dtype == torch.float64 else z.float()
    z = z / temperature
    lp = torch.log_softmax(z, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    return lp, ent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk", [1, 97, 300, 5000])  # one position, part of a row, whole rows, several rows
def test_blocks_equal_the_plain_values_and_gradients(dtype, chunk):
    g = torch.Generator().manual_seed(0)
    B, T, V = 5, 13, 41
    base = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    y = torch.randint(0, V, (B, T), generator=g)
    w = torch.randn(B, T, generator=g, dtype=torch.float64)
    z1 = base.clone().requires_grad_(True)
    z2 = base.clone().requires_grad_(True)
    lp1, ent1 = _plain(z1, y, 0.7)
    lp2, ent2 = L.token_log_probs(z2, y, 0.7, calculate_entropy=True, chunk_elements=chunk)
    assert ent2 is not None and lp2.dtype == lp1.dtype and lp2.shape == (B, T)
    assert torch.equal(lp1, lp2) and torch.equal(ent1, ent2)  # row-wise formulas: blocking changes no value
    ((lp1 * w).sum() + (ent1 * w).sum()).backward()
    ((lp2 * w).sum() + (ent2 * w).sum()).backward()
    assert torch.allclose(z1.grad.double(), z2.grad.double(), rtol=1e-5, atol=1e-6)
    assert torch.equal(L.token_entropy(base.float(), chunk_elements=chunk), _plain(base.float(), y, 1.0)[1])


def test_blocked_gradient_matches_autograd_of_the_plain_formula_in_float64():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (3, 7), generator=g)

    def f(x):
        lp, ent = L.token_log_probs(x, y, 1.3, calculate_entropy=True, chunk_elements=20)
        return lp.sum() + 0.5 * ent.sum()

    assert torch.autograd.gradcheck(f, (z,))


def test_blocks_bound_the_float32_temporaries():
    """At a real vocabulary a block holds at most CHUNK_ELEMENTS logits: the peak extra memory of a blocked
    pass is a few blocks, not several copies of the whole tensor."""
    blocks = L._blocks(torch.Size([64, 128]), 49152, L.CHUNK_ELEMENTS)
    sizes = [(b.stop - b.start) * (t.stop - t.start) * 49152 for b, t in blocks]
    assert max(sizes) <= L.CHUNK_ELEMENTS and sum(sizes) == 64 * 128 * 49152
    small = L._blocks(torch.Size([64, 32]), 100, L.CHUNK_ELEMENTS)
    assert small == [(slice(0, 64), slice(0, 32))]


def test_engine_functions_use_the_blocks_and_agree_with_the_plain_formula():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 9, 17, generator=g)
    ids = torch.randint(0, 17, (2, 9), generator=g)
    lp, ent = response_log_probs(logits, ids, 4, temperature=0.5, calculate_entropy=True)
    ref_lp, ref_ent = _plain(logits[:, -5:-1], ids[:, -4:], 0.5)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    assert torch.equal(entropy_from_logits(logits), _plain(logits, ids, 1.0)[1])


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="do not match"):
        L.token_log_probs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
