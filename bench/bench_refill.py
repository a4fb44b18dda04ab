"""Dynamic-sampling refill policies, simulated: kept groups thrown away as surplus against generation rounds.

A step generates batches until `train_batch_size` groups are kept; kept groups beyond that are thrown away
(docs/REFERENCE.md §6.1 step 10). Each prompt is kept independently (Binomial) at a keep rate; no model is
involved, only the prompt accounting. All adaptive policies use the run-wide `KeepRateEstimator` (decay 0.9).

`budget`: per-step keep rates from a finished run's `kept_g*` manifests (`--run`, e.g. `runs/<id>` of a
`make train`) or a constant `--keep-rate`, with the policies
- `fixed`: every batch `gen_batch_size` prompts (the reference, `refill=fixed`);
- `budget<x>`: `surplus_bounded_size`, the largest batch whose expected surplus is at most
  x · train_batch_size groups (`refill=adaptive` with `algorithm.filter_groups.surplus_budget=x`);
- `safety<s>`: `next_gen_batch_size`, deficit / keep rate · s.

`simulate`: fixed against `next_gen_batch_size` at keep rates 0.2 / 0.4 / 0.7 (DAPO's 512 / 1536 shape).

    .venv/bin/python bench/bench_refill.py budget --keep-rate 0.85 --train-batch-size 32 --gen-batch-size 64
    .venv/bin/python bench/bench_refill.py budget --run runs/<id> [--train-batch-size 16 --gen-batch-size 32]
    .venv/bin/python bench/bench_refill.py simulate [--steps 300] [--seed 0] [--min-size 64] [--safety 1.2]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_core.algo.dynamic_sampling import KeepRateEstimator, next_gen_batch_size, surplus_bounded_size

SizeFn = Callable[[int, float | None], int]
"""(deficit in groups, estimated keep rate or None) -> prompts to generate next."""


def run_keep_rates(run: Path) -> list[float]:
    """Per step, kept / generated groups over all of that step's filtered batches (kept_g*.manifest.json)."""
    rates = []
    for step_dir in sorted(run.glob("step_*")):
        kept = seen = 0.0
        for f in sorted(step_dir.glob("kept_g*.manifest.json")):
            m = json.loads(f.read_text())["meta"]["metrics"]
            kept += m["train/num_kept_groups"]
            seen += m["train/num_groups"]
        if seen:
            rates.append(kept / seen)
    if not rates:
        raise SystemExit(f"{run}: no kept_g*.manifest.json under step_*/ (a run with filter_groups.enable)")
    return rates


def simulate_steps(size_fn: SizeFn, rates: Sequence[float], *, tbs: int, seed: int) -> dict[str, float]:
    """One step per entry of `rates`; per-step means of surplus groups, rounds and prompts, and the surplus
    as a share of the kept groups used."""
    rng = np.random.default_rng(seed)
    est = KeepRateEstimator(decay=0.9)
    surplus, rounds, prompts = [], [], []
    for p in rates:
        kept = r = n = 0
        while kept < tbs:
            size = size_fn(tbs - kept, est.rate)
            k = int(rng.binomial(size, p))
            est.update(k, size)
            kept, r, n = kept + k, r + 1, n + size
        surplus.append(kept - tbs)
        rounds.append(r)
        prompts.append(n)
    return {
        "surplus_groups": float(np.mean(surplus)),
        "surplus_share": float(np.sum(surplus) / (tbs * len(rates))),
        "gen_batches_per_step": float(np.mean(rounds)),
        "prompts_per_step": float(np.mean(prompts)),
    }


def policy_size_fn(policy: str, *, tbs: int, gbs: int, min_size: int = 1) -> SizeFn:
    """The batch-size rule named `policy` (`fixed`, `budget<x>`, `safety<s>`)."""
    if policy == "fixed":
        return lambda deficit, rate: gbs
    if policy.startswith("safety"):
        s = float(policy[len("safety") :])
        return lambda deficit, rate: next_gen_batch_size(deficit, rate, base=gbs, min_size=min_size, safety=s)
    if policy.startswith("budget"):
        budget = float(policy[len("budget") :]) * tbs
        return lambda deficit, rate: surplus_bounded_size(deficit, rate, surplus_budget=budget, base=gbs)
    raise SystemExit(f"unknown policy {policy!r}: use fixed, budget<x> or safety<s>")


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
    """`steps` steps at constant keep rate `p`: fixed batches, or `next_gen_batch_size` when `adaptive`."""
    policy = f"safety{safety}" if adaptive else "fixed"
    size_fn = policy_size_fn(policy, tbs=train_batch_size, gbs=gen_batch_size, min_size=min_size)
    return simulate_steps(size_fn, [p] * steps, tbs=train_batch_size, seed=seed)


def _budget(args: argparse.Namespace) -> None:
    rates = run_keep_rates(Path(args.run)) if args.run else [args.keep_rate] * args.steps
    tbs, gbs = args.train_batch_size, args.gen_batch_size
    print(
        f"train_batch_size={tbs} gen_batch_size={gbs}; {len(rates)} steps, keep rate mean "
        f"{np.mean(rates):.3f} (min {min(rates):.2f}, max {max(rates):.2f}); means over {args.seeds} seeds"
    )
    print("| policy | surplus (% of kept groups used) | generation rounds / step | prompts / step |")
    print("|---|---|---|---|")
    for policy in args.policies.split(","):
        size_fn = policy_size_fn(policy, tbs=tbs, gbs=gbs)
        res = [simulate_steps(size_fn, rates, tbs=tbs, seed=s) for s in range(args.seeds)]
        m = {k: float(np.mean([r[k] for r in res])) for k in res[0]}
        print(
            f"| {policy} | {100 * m['surplus_share']:.2f} % | {m['gen_batches_per_step']:.2f} | "
            f"{m['prompts_per_step']:.1f} |"
        )


def _simulate(args: argparse.Namespace) -> None:
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


def main(argv: list[str] | None = None) -> None:
    """Print a markdown table for the chosen comparison."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("budget", help="fixed / budget<x> / safety<s> on a run's or a constant keep rate")
    b.add_argument("--run", default="", help="a finished run folder with filter_groups on")
    b.add_argument("--keep-rate", type=float, default=0.6, help="constant keep rate when --run is not given")
    b.add_argument("--steps", type=int, default=100, help="steps of the constant keep rate")
    b.add_argument("--train-batch-size", type=int, default=16)
    b.add_argument("--gen-batch-size", type=int, default=32)
    b.add_argument("--seeds", type=int, default=200)
    b.add_argument("--policies", default="fixed,budget0.005,budget0.05,budget0.1,budget0.2")
    b.set_defaults(func=_budget)
    s = sub.add_parser("simulate", help="fixed against next_gen_batch_size at keep rates 0.2 / 0.4 / 0.7")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--train-batch-size", type=int, default=512)
    s.add_argument("--gen-batch-size", type=int, default=1536)
    s.add_argument("--min-size", type=int, default=64, help="smallest adaptive refill (prompts)")
    s.add_argument("--safety", type=float, default=1.2)
    s.set_defaults(func=_simulate)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
