"""bfloat16 against float32 at the real config's shape: speed of each phase and the log-prob difference.

On one thread, for the real model (`models/smollm2_135m`, from `dapo import-model`) and the real config's
batch (`--prompts` word problems × `--n` samples in the training chat template, up to `--new-tokens` tokens at
temperature 1):

- **generate**: our HF rollout engine in float32 and in bfloat16 weights, tokens per second (median of
  `--repeats` after a warm-up);
- **log-prob difference of the rollout**: each rollout's own per-token log-probs against the float32
  teacher-forced forward of the same tokens (what bypass mode's π_old and the rollout IS weights see): mean,
  p99 and largest |Δ|, the share of tokens whose ratio exp(Δ) leaves [0.5, 2], the sequence ratios' spread;
- **the actor** (`--phases actor`): the torch training engine's own update work on the sampled rows
  (shared-prompt forward, token log-probs, backward of their masked sum, one group per micro-batch) in
  float32, under autocast bfloat16 (`compute_dtype`, `actor.fsdp_config.mixed_precision.param_dtype`), and
  under autocast with the LM head kept in float32; and each one's eval-mode log-probs against float32's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_bf16.py --prompts 8 --n 8 --new-tokens 48

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def teacher_forced(model, prompts: list[list[int]], responses: list[list[int]]) -> list:
    """Per-token log-probs of `responses` after `prompts`, one row at a time (no padding in the numbers)."""
    from dapo_core.compute.logits import token_log_probs

    out = []
    for p, r in zip(prompts, responses, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float()
        out.append(token_log_probs(logits, torch.tensor(r))[0])
    return out


def float32_head(model) -> None:
    """Run the LM head outside autocast, on float32 hidden states (the logits keep full precision)."""
    head = model.get_output_embeddings()
    linear = head.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return linear(x.float())

    head.forward = forward


def engine_forward_backward_s(engine, batch: dict, n: int) -> float:
    """Seconds of the actor's update work through the training engine's own path (shared-prompt forward,
    token log-probs, backward of their masked sum), one prompt's `n` rows per micro-batch."""
    L = batch["responses"].shape[1]
    t0 = time.perf_counter()
    for g in range(0, batch["input_ids"].shape[0], n):
        rows = {k: batch[k][g : g + n] for k in ("input_ids", "attention_mask", "position_ids")}
        lp, _ = engine.forward(**rows, response_length=L, share_prompt=True)
        (lp * batch["response_mask"][g : g + n]).sum().backward()
    engine.model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def engine_log_probs(engine, batch: dict, n: int) -> list[torch.Tensor]:
    """Per-row response log-probs (valid tokens only) of the engine's eval-mode forward."""
    L = batch["responses"].shape[1]
    engine.eval()
    out = []
    for g in range(0, batch["input_ids"].shape[0], n):
        rows = {k: batch[k][g : g + n] for k in ("input_ids", "attention_mask", "position_ids")}
        lp, _ = engine.forward(**rows, response_length=L, share_prompt=True)
        for row, m in zip(lp, batch["response_mask"][g : g + n], strict=True):
            out.append(row[m.bool()])
    engine.train()
    return out


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
    ap.add_argument(
        "--phases",
        default="generate,actor",
        help="generate: time both rollout dtypes and their log-prob difference; actor: the training "
        "engine's forward + backward and log-probs per precision (without generate, on one bf16 sample)",
    )
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    from bench_vllm import word_prompts

    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
    from dapo_core.compute.engines.rollout import SamplingParams
    from dapo_core.compute.engines.train import make_train_engine
    from dapo_core.compute.models import load_model
    from dapo_core.data.batch import to_padded

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
    for dtype in ("float32", "bfloat16") if "generate" in phases else ("bfloat16",):
        engine = HFRolloutEngine(model, dtype=dtype, max_batch_size=rows, seed=0)
        done = engine.generate(prompts, params, seeds)  # the warm-up, and the only run without "generate"
        times = []
        for _ in range(args.repeats if "generate" in phases else 0):
            t0 = time.perf_counter()
            done = engine.generate(prompts, params, seeds)
            times.append(time.perf_counter() - t0)
        samples[dtype] = done
        if times:
            tokens = sum(len(c.token_ids) for c in done)
            med = statistics.median(times)
            res[f"generate_{dtype}"] = {"tokens": tokens, "s": med, "tok_per_s": tokens / med}
        engine.close()
    if "generate" in phases:
        actor = load_model(model, dtype=torch.float32)
        for dtype, done in samples.items():
            fp32 = teacher_forced(actor, prompts, [c.token_ids for c in done])
            res[f"rollout_{dtype}_vs_float32_forward"] = difference([c.log_probs for c in done], fp32)
        del actor
    if "actor" not in phases:
        print(json.dumps(res, indent=1))
        return
    responses = [c.token_ids for c in samples.get("float32", samples["bfloat16"])]
    # the actor's padded layout, as the flow builds it (pad id 0: padded positions are masked out)
    batch = to_padded(pa.table({"prompt_ids": prompts, "response_ids": responses}), 0)
    engines = {
        "float32": make_train_engine("torch", model, {"lr": 1e-6}, total_steps=1, grad_clip=1.0),
        "autocast_bfloat16": make_train_engine(
            "torch", model, {"lr": 1e-6}, total_steps=1, grad_clip=1.0, compute_dtype=torch.bfloat16
        ),
        "autocast_bfloat16_float32_head": make_train_engine(
            "torch", model, {"lr": 1e-6}, total_steps=1, grad_clip=1.0, compute_dtype=torch.bfloat16
        ),
    }
    float32_head(engines["autocast_bfloat16_float32_head"].model)
    reference = [x.tolist() for x in engine_log_probs(engines["float32"], batch, args.n)]
    for name, engine in engines.items():
        if name != "float32":
            lps = engine_log_probs(engine, batch, args.n)
            res[f"actor_{name}_vs_float32"] = difference(reference, lps)
        engine_forward_backward_s(engine, batch, args.n)  # warm-up
        times = [engine_forward_backward_s(engine, batch, args.n) for _ in range(args.repeats)]
        res[f"actor_forward_backward_{name}_s"] = statistics.median(times)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
