"""The ground truth the vLLM-CPU tests compare against: HF transformers run without a KV cache.

Greedy decoding takes the argmax of a full forward per step (`reference_greedy`), or, for a whole completion
at once, of one forward over prompt + response (`assert_greedy_is_hf`); log-probs are
log_softmax(logits / T) teacher-forced on prompt + response, which is what the training engine recomputes.
"""

from __future__ import annotations

import torch


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """Greedy decoding with a full forward pass per step (no KV cache): the ground truth."""
    seq = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            tok = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok == eos:
                break
    return out


def teacher_forced(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits / T)[token] for each response token, from one forward over prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response)]


def max_logprob_gap(model: torch.nn.Module, prompts, completions, temperature: float) -> float:
    """Largest |engine log-prob - teacher-forced log-prob| over all rows and tokens."""
    gap = 0.0
    for p, c in zip(prompts, completions, strict=True):
        ref = teacher_forced(model, p, c.token_ids, temperature)
        assert len(c.log_probs) == len(c.token_ids) == len(ref)
        gap = max(gap, max(abs(a - b) for a, b in zip(c.log_probs, ref, strict=True)))
    return gap


def assert_greedy_is_hf(model: torch.nn.Module, prompts, completions, max_new: int, eos: int, tol: float):
    """Each completion is `model`'s greedy decoding and its log-probs the teacher-forced recompute within
    `tol`, checked with one forward over prompt + response per row: every response token is the argmax of the
    logits at its position (causal attention makes those `reference_greedy`'s per-step logits), and the
    response stops exactly at the first eos or at `max_new` tokens."""
    gap = 0.0
    for p, c in zip(prompts, completions, strict=True):
        response = list(c.token_ids)
        assert 0 < len(response) <= max_new and eos not in response[:-1], response
        assert response[-1] == eos or len(response) == max_new, response
        with torch.no_grad():
            logits = model(torch.tensor([list(p) + response])).logits[0].float()
        at = logits[len(p) - 1 : len(p) - 1 + len(response)]
        assert at.argmax(dim=-1).tolist() == response, "a response token is not the argmax of its logits"
        logp = torch.log_softmax(at, dim=-1)
        ref = [float(logp[i, t]) for i, t in enumerate(response)]
        assert len(c.log_probs) == len(ref)
        gap = max(gap, max(abs(a - b) for a, b in zip(c.log_probs, ref, strict=True)))
    assert gap < tol, f"max |vLLM - teacher-forced| = {gap:.2e}"
