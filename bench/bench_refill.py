"""Dynamic-sampling refill policies, simulated: kept groups thrown away as surplus against generation rounds.

A step generates batches until `train_batch_size` groups are kept; kept groups beyond that are thrown away
(docs/REFERENCE.md §6.1 step 10). Each prompt is kept independently (Binomial) at a keep rate; no model is
involved, only the prompt accounting (`tests.helpers.simulate_refill_steps`). All adaptive policies use the
run-wide `KeepRateEstimator` (decay 0.9).

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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import refill_policy_size_fn, simulate_refill, simulate_refill_steps


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
        size_fn = refill_policy_size_fn(policy, tbs=tbs, gbs=gbs)
        res = [simulate_refill_steps(size_fn, rates, tbs=tbs, seed=s) for s in range(args.seeds)]
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
            r = simulate_refill(
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
