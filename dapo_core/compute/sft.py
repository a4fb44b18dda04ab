"""Supervised warm-up of the tiny base model before DAPO.

A randomly initialised tiny model cannot produce a single ``Answer: <n>`` line, so every rollout would score
−1, every group would be filtered by dynamic sampling, and RL would never start. A short supervised phase on
prompt + worked solution (loss on the solution tokens only) teaches the format and part of the skill; it is
deliberately short so the held-out accuracy stays low and RL has room to climb.

- :func:`synthetic_solution` writes the target for a synthetic arithmetic row (``data.make_synthetic_math``).
- :func:`warmup_sft` trains an HF model folder in place (plain torch, AdamW, warm-up + cosine LR) and saves
  it back as an HF folder.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dapo_core.data.datasets import tokenize_prompt

__all__ = ["SFTError", "carry_slip_solution", "encode_sft_example", "synthetic_solution", "warmup_sft"]


class SFTError(ValueError):
    """A warm-up argument or example is unusable; the message names it and the fix."""


def synthetic_solution(row: dict[str, Any]) -> str:
    """Short worked solution of a synthetic arithmetic row: ``<expr>=<n>`` then ``Answer: <n>``.

    The expression comes from ``extra_info.expression`` (written by ``make_synthetic_math``); rows without it
    fall back to the bare answer line.
    """
    try:
        answer = str(row["reward_model"]["ground_truth"])
    except (KeyError, TypeError) as e:
        raise SFTError("row needs reward_model.ground_truth to build a synthetic solution") from e
    expr = (row.get("extra_info") or {}).get("expression")
    if expr:
        return f"{expr}={answer}\nAnswer: {answer}"
    return f"Answer: {answer}"


def answer_line_solution(row: dict[str, Any], *, answer_line_prob: float = 1.0, seed: int = 0) -> str:
    """A worked solution that ends with the ``Answer: <n>`` line only for a share ``answer_line_prob`` of
    rows.

    The rest stop after the worked line (``47+38=85``), which ``math_dapo`` scores −1 (no ``Answer:`` line): a
    base model warmed up on this mix computes the sums but often forgets the final line, as
    instruction-following models do. Which rows keep the line is a pure function of (problem, seed).
    """
    full = synthetic_solution(row)
    if answer_line_prob >= 1.0:
        return full
    key = f"{seed}|{(row.get('extra_info') or {}).get('expression')}|{row['reward_model']['ground_truth']}"
    u = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2.0**64
    if u < answer_line_prob:
        return full
    return full.split("\n", 1)[0]


def _no_carry_sum(a: int, b: int) -> int:
    """``a + b`` computed digit by digit without carrying (a classic slip): 58+67 -> 15."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def carry_slip_solution(row: dict[str, Any], *, slip_prob: float = 0.6, seed: int = 0) -> str:
    """Like :func:`synthetic_solution`, but a fixed fraction of sums is written *without carrying*.

    Models a base model that learned arithmetic from imperfect text: it has the features for the correct
    sum but also a systematic misconception. Which rows slip is a deterministic function of the expression
    and ``seed`` (a stable hash, not Python's ``hash``), so the warm-up data is reproducible. Only
    two-operand ``+`` problems with non-negative operands can slip; other rows get the correct solution.
    """
    import hashlib

    expr = (row.get("extra_info") or {}).get("expression", "")
    parts = expr.split("+")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return synthetic_solution(row)
    digest = hashlib.sha256(f"{seed}:{expr}".encode()).digest()
    if int.from_bytes(digest[:8], "big") / 2**64 >= slip_prob:
        return synthetic_solution(row)
    wrong = _no_carry_sum(int(parts[0]), int(parts[1]))
    return f"{expr}={wrong}\nAnswer: {wrong}"


def encode_sft_example(tokenizer: Any, row: dict[str, Any], solution: str) -> tuple[list[int], int]:
    """Token ids of prompt (chat template + generation prompt) + solution + EOS, and the prompt length."""
    if tokenizer.eos_token_id is None:
        raise SFTError("the tokenizer has no eos_token; the warm-up must teach the model to stop")
    prompt_ids = tokenize_prompt(tokenizer, row["prompt"])
    answer_ids = list(tokenizer(solution, add_special_tokens=False)["input_ids"])
    return prompt_ids + answer_ids + [tokenizer.eos_token_id], len(prompt_ids)


def _lr_at(step: int, steps: int, lr: float, warmup: int, min_lr_ratio: float) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def warmup_sft(
    model_dir: str | Path,
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    solution_fn: Callable[[dict[str, Any]], str] = synthetic_solution,
    warmup_steps: int = 10,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    log_every: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune the HF model in ``model_dir`` on ``rows`` for ``steps`` steps and save it back in place.

    Each step samples ``batch_size`` rows (seeded, with replacement across epochs), builds prompt + solution
    (``solution_fn(row)``) + EOS, and minimises the token-mean cross-entropy over the solution and EOS
    tokens only. Returns metrics: ``loss_first`` / ``loss_last`` (mean of the first / last 10 % of
    steps), ``losses`` (per step), ``steps``, ``tokens`` (supervised tokens seen), ``wall_s``.
    ``on_step(steps_done, loss)``, when given, is called after every step (a progress display).
    """
    from transformers import AutoModelForCausalLM

    if steps < 1:
        raise SFTError(f"steps={steps} must be >= 1 (actor_rollout_ref.model.sft.steps)")
    if batch_size < 1:
        raise SFTError(f"batch_size={batch_size} must be >= 1 (actor_rollout_ref.model.sft.batch_size)")
    if not rows:
        raise SFTError("rows is empty; pass the training split to warm up on")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise SFTError(
            f"{model_dir} has no config.json; build the base model first (models.build_tiny_model)"
        )

    t0 = time.perf_counter()
    examples = [encode_sft_example(tokenizer, r, solution_fn(r)) for r in rows]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    warmup = min(warmup_steps, max(1, steps // 10))

    order = rng.permutation(len(examples))
    cursor = 0
    losses: list[float] = []
    tokens = 0
    for step in range(steps):
        idx: list[int] = []
        while len(idx) < batch_size:
            if cursor >= len(order):
                order, cursor = rng.permutation(len(examples)), 0
            idx.append(int(order[cursor]))
            cursor += 1
        batch = [examples[i] for i in idx]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for b, (ids, plen) in enumerate(batch):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            attention[b, : len(ids)] = 1
            labels[b, plen : len(ids)] = torch.tensor(ids[plen:])
        for group in optim.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup, min_lr_ratio)
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
        target = labels[:, 1:]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100
        )
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optim.step()
        losses.append(float(loss.detach()))
        tokens += int((target != -100).sum())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(
                f"[sft] step {step}/{steps} loss {losses[-1]:.4f} lr {optim.param_groups[0]['lr']:.2e}",
                flush=True,
            )
        if on_step is not None:  # a progress display: (steps done, this step's loss)
            on_step(step + 1, losses[-1])

    model.eval()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    k = max(1, steps // 10)
    return {
        "loss_first": float(np.mean(losses[:k])),
        "loss_last": float(np.mean(losses[-k:])),
        "losses": losses,
        "steps": steps,
        "tokens": tokens,
        "wall_s": time.perf_counter() - t0,
    }
