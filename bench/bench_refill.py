"""Simulate DAPO's dynamic-sampling loop: fixed gen_batch_size refills (reference) vs adaptive refills.

Each sampled prompt's group survives filtering independently with probability p (p ∈ {0.2, 0.4, 0.7}). A step
keeps generating batches until at least ``train_batch_size`` groups are kept; kept groups beyond that are
thrown away as surplus (docs/REFERENCE.md §6.1 step 10). Fixed mode always asks for ``gen_batch_size``
prompts; adaptive mode asks ``next_gen_batch_size(deficit, KeepRateEstimator.rate, base=gen_batch_size, ...)``
(the very first batch of the run uses ``gen_batch_size``). No model is involved: this measures only the prompt
accounting.

    .venv/bin/python bench/bench_refill.py [--steps 300] [--seed 0] [--min-size 64] [--safety 1.2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_core.algo.dynamic_sampling import KeepRateEstimator, next_gen_batch_size


def simulate(
    p: float,
    adaptive: bool,
    *,
    steps: int,
    train_batch_size: int,
    gen_batch_size: int,
    min_size: int,
    safety: float,
    seed: int,
) -> dict[str, float]:
    """Run ``steps`` training steps; return per-step means of surplus groups, prompts and generation
    batches."""
    rng = np.random.default_rng(seed)
    est = KeepRateEstimator(decay=0.9)
    surplus, prompts, batches = [], [], []
    for _ in range(steps):
        kept = n_prompts = n_batches = 0
        while kept < train_batch_size:
            if adaptive:
                size = next_gen_batch_size(
                    train_batch_size - kept, est.rate, base=gen_batch_size, min_size=min_size, safety=safety
                )
            else:
                size = gen_batch_size
            k = int(rng.binomial(size, p))
            est.update(k, size)
            kept += k
            n_prompts += size
            n_batches += 1
        surplus.append(kept - train_batch_size)
        prompts.append(n_prompts)
        batches.append(n_batches)
    return {
        "surplus_groups": float(np.mean(surplus)),
        "prompts_per_step": float(np.mean(prompts)),
        "gen_batches_per_step": float(np.mean(batches)),
    }


def main(argv: list[str] | None = None) -> None:
    """Print a markdown table of both modes for each keep probability."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-batch-size", type=int, default=512)
    ap.add_argument("--gen-batch-size", type=int, default=1536)
    ap.add_argument("--min-size", type=int, default=64, help="smallest adaptive refill (prompts)")
    ap.add_argument("--safety", type=float, default=1.2)
    args = ap.parse_args(argv)
    print(
        f"train_batch_size={args.train_batch_size} gen_batch_size={args.gen_batch_size} steps={args.steps} "
        f"seed={args.seed} adaptive: min_size={args.min_size} safety={args.safety}"
    )
    print("| p | mode | surplus kept groups / step | prompts generated / step | gen batches / step |")
    print("|---|---|---|---|---|")
    for p in (0.2, 0.4, 0.7):
        for adaptive in (False, True):
            r = simulate(
                p,
                adaptive,
                steps=args.steps,
                train_batch_size=args.train_batch_size,
                gen_batch_size=args.gen_batch_size,
                min_size=args.min_size,
                safety=args.safety,
                seed=args.seed,
            )
            mode = "adaptive" if adaptive else "fixed"
            print(
                f"| {p} | {mode} | {r['surplus_groups']:.1f} | {r['prompts_per_step']:.1f} | "
                f"{r['gen_batches_per_step']:.2f} |"
            )


if __name__ == "__main__":
    main()
