"""Adaptive refill by expected surplus: kept groups thrown away and generation rounds per step, simulated on a
real keep-rate sequence.

A step generates batches until `train_batch_size` groups are kept; kept groups beyond that are thrown away
(docs/REFERENCE.md §6.1 step 10). Each prompt of step t is kept with that step's observed keep rate p_t, read
from a finished run's `kept_g*` manifests (`--run`, e.g. `runs/<id>` of a `make train`), or a constant
`--keep-rate`. Policies, all with the run-wide `KeepRateEstimator` (decay 0.9) that `refill=adaptive` uses:

- `fixed`: every batch `gen_batch_size` prompts (the reference, `refill=fixed`);
- `safety1.2`: `next_gen_batch_size`, deficit / rate · 1.2 (the former `refill=adaptive`);
- `budget<x>`: `surplus_bounded_size` with an expected-surplus budget of x · train_batch_size groups per
  batch (`refill=adaptive` with `algorithm.filter_groups.max_surplus=x`).

    .venv/bin/python bench/bench_refill_budget.py --run runs/<id> [--train-batch-size 16 --gen-batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_core.algo.dynamic_sampling import KeepRateEstimator, next_gen_batch_size, surplus_bounded_size


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


def size_for(policy: str, deficit: int, rate: float | None, tbs: int, gbs: int) -> int:
    """The batch size `policy` asks for."""
    if policy == "fixed":
        return gbs
    if policy.startswith("safety"):
        return next_gen_batch_size(deficit, rate, base=gbs, safety=float(policy[6:]))
    budget = float(policy[6:]) * tbs
    return surplus_bounded_size(deficit, rate, surplus_budget=budget, base=gbs)


def simulate(policy: str, rates: list[float], *, tbs: int, gbs: int, seed: int) -> dict[str, float]:
    """One pass over `rates` (one step each); per-step means of surplus, rounds and prompts."""
    rng = np.random.default_rng(seed)
    est = KeepRateEstimator(decay=0.9)
    surplus, rounds, prompts = [], [], []
    for p in rates:
        kept = r = n = 0
        while kept < tbs:
            size = size_for(policy, tbs - kept, est.rate, tbs, gbs)
            k = int(rng.binomial(size, p))
            est.update(k, size)
            kept, r, n = kept + k, r + 1, n + size
        surplus.append(kept - tbs)
        rounds.append(r)
        prompts.append(n)
    return {
        "surplus_share": float(np.sum(surplus) / (tbs * len(rates))),
        "rounds": float(np.mean(rounds)),
        "prompts": float(np.mean(prompts)),
    }


def main(argv: list[str] | None = None) -> None:
    """Print a markdown table of the policies (means over --seeds passes of the keep-rate sequence)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="", help="a finished run folder with filter_groups on")
    ap.add_argument("--keep-rate", type=float, default=0.6, help="constant keep rate when --run is not given")
    ap.add_argument("--steps", type=int, default=100, help="steps of the constant keep rate")
    ap.add_argument("--train-batch-size", type=int, default=16)
    ap.add_argument("--gen-batch-size", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--policies", default="fixed,safety1.2,budget0.02,budget0.01,budget0.005")
    args = ap.parse_args(argv)
    rates = run_keep_rates(Path(args.run)) if args.run else [args.keep_rate] * args.steps
    tbs, gbs = args.train_batch_size, args.gen_batch_size
    print(
        f"train_batch_size={tbs} gen_batch_size={gbs}; {len(rates)} steps, keep rate mean "
        f"{np.mean(rates):.3f} (min {min(rates):.2f}, max {max(rates):.2f}); means over {args.seeds} seeds"
    )
    print("| policy | surplus (% of kept groups used) | generation rounds / step | prompts / step |")
    print("|---|---|---|---|")
    for policy in args.policies.split(","):
        res = [simulate(policy, rates, tbs=tbs, gbs=gbs, seed=s) for s in range(args.seeds)]
        m = {k: float(np.mean([r[k] for r in res])) for k in res[0]}
        print(f"| {policy} | {100 * m['surplus_share']:.2f} % | {m['rounds']:.2f} | {m['prompts']:.1f} |")


if __name__ == "__main__":
    main()
