"""bfloat16 against float32 at the real config's shape: speed of each phase and the log-prob difference.

On one thread, for the real model (`models/smollm2_135m`, from `dapo import-model`) and the real config's
batch (`--prompts` word problems × `--n` samples in the training chat template, up to `--new-tokens` tokens at
temperature 1):

- **generate**: our HF rollout engine in float32 and in bfloat16 weights, tokens per second (median of
  `--repeats` after a warm-up);
- **forward + backward**: the actor's work on the sampled rows (teacher-forced forward, token log-probs, the
  backward of their sum) in float32 and under `torch.autocast(bfloat16)` (float32 weights and gradients);
- **log-prob difference**: each rollout's own per-token log-probs against the float32 teacher-forced forward
  of the same tokens (what bypass mode's π_old and the rollout IS weights see): mean and largest |Δ|, the
  share of tokens whose ratio exp(Δ) leaves [0.5, 2], and the spread of the sequence-level ratio; and the
  autocast forward against the float32 one (what a bf16 actor would change).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_bf16.py --prompts 8 --n 8 --new-tokens 48

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def teacher_forced(model, prompts: list[list[int]], responses: list[list[int]], autocast: bool) -> list:
    """Per-token log-probs of `responses` after `prompts`, one row at a time (no padding in the numbers)."""
    from dapo_core.compute.logits import token_log_probs

    out = []
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    for p, r in zip(prompts, responses, strict=True):
        with ctx, torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float()
        out.append(token_log_probs(logits, torch.tensor(r))[0])
    return out


def forward_backward_s(model, prompts: list[list[int]], responses: list[list[int]], n: int, autocast: bool):
    """Seconds of the actor's work on the rows, a prompt's `n` rows per micro-batch (right-padded): forward,
    token log-probs, backward of their masked sum."""
    from dapo_core.compute.logits import token_log_probs

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    t0 = time.perf_counter()
    for g in range(0, len(prompts), n):
        p, rs = prompts[g], responses[g : g + n]
        width = max(len(r) for r in rs)
        ids = torch.tensor([p + r + [0] * (width - len(r)) for r in rs])
        mask = torch.tensor([[1] * (len(p) + len(r)) + [0] * (width - len(r)) for r in rs])
        with ctx:
            logits = model(input_ids=ids, attention_mask=mask).logits[:, len(p) - 1 : -1].float()
        lp, _ = token_log_probs(logits, ids[:, len(p) :])
        (lp * mask[:, len(p) :]).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def difference(rollout: list[list[float]], forward: list[torch.Tensor]) -> dict[str, float]:
    """|Δ| statistics of per-token log-probs, the share of token ratios outside [0.5, 2] and the sequence
    ratios' spread (Δ = forward − rollout, the ratio π_forward / π_rollout)."""
    d = torch.cat([f - torch.tensor(r) for r, f in zip(rollout, forward, strict=True)])
    seq = torch.stack([(f - torch.tensor(r)).sum() for r, f in zip(rollout, forward, strict=True)])
    return {
        "tokens": int(d.numel()),
        "mean_abs": float(d.abs().mean()),
        "p99_abs": float(d.abs().quantile(0.99)),
        "max_abs": float(d.abs().max()),
        "token_ratio_outside_0.5_2": float((d.abs() > math.log(2)).float().mean()),
        "seq_ratio_min": float(seq.exp().min()),
        "seq_ratio_max": float(seq.exp().max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2_135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from bench_vllm import word_prompts

    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
    from dapo_core.compute.engines.rollout import SamplingParams
    from dapo_core.compute.models import load_model

    model = ROOT / args.model
    rows = args.prompts * args.n
    prompts = word_prompts(model, rows, args.n)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    seeds = list(range(rows))
    flags = Path("/proc/cpuinfo").read_text().split()
    res: dict = {
        "threads": torch.get_num_threads(),
        "rows": rows,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_flags": sorted({f for f in flags if "bf16" in f}),
    }
    samples = {}
    for dtype in ("float32", "bfloat16"):
        engine = HFRolloutEngine(model, dtype=dtype, max_batch_size=rows, seed=0)
        engine.generate(prompts, params, seeds)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            done = engine.generate(prompts, params, seeds)
            times.append(time.perf_counter() - t0)
        tokens = sum(len(c.token_ids) for c in done)
        samples[dtype] = done
        med = statistics.median(times)
        res[f"generate_{dtype}"] = {"tokens": tokens, "s": med, "tok_per_s": tokens / med}
        engine.close()
    actor = load_model(model, dtype=torch.float32)
    for dtype, done in samples.items():
        fp32 = teacher_forced(actor, prompts, [c.token_ids for c in done], autocast=False)
        res[f"rollout_{dtype}_vs_float32_forward"] = difference([c.log_probs for c in done], fp32)
    responses = [c.token_ids for c in samples["float32"]]
    fp32 = teacher_forced(actor, prompts, responses, autocast=False)
    bf16 = teacher_forced(actor, prompts, responses, autocast=True)
    res["autocast_forward_vs_float32_forward"] = difference([x.tolist() for x in fp32], bf16)
    actor.train()
    for name, autocast in (("float32", False), ("autocast_bfloat16", True)):
        forward_backward_s(actor, prompts, responses, args.n, autocast)  # warm-up
        times = [forward_backward_s(actor, prompts, responses, args.n, autocast) for _ in range(args.repeats)]
        res[f"forward_backward_{name}_s"] = statistics.median(times)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
