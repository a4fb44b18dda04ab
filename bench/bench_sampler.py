"""The history-aware prompt sampler against verl's sampler: zero-spread groups generated and held-out accuracy
per training minute.

Trains the CPU default (`configs/tiny_cpu.yaml`, in-process workers, ephemeral Prefect) from the project's
`models/tiny_base` on the first `--train-rows` rows of `data/train.parquet` (few enough that prompts come
back within the run: an epoch is about train_rows / prompts-per-step steps), once with `data.history_sampler`
off and once on, and reports per variant: the share of generated groups without reward spread (from the
`kept_g*` manifests: 1 − kept / generated), generated prompts per step, the held-out accuracy
(`val-core/.../acc/mean@1` on `data/val.parquet`) before and after, and its gain per minute of training
(Σ `timing_s/step`).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sampler.py --steps 40 --train-rows 160
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def zero_spread_share(run: Path) -> tuple[float, float]:
    """(share of generated groups without reward spread, generated groups) over the run's filtered batches."""
    kept = seen = 0.0
    for f in run.glob("step_*/kept_g*.manifest.json"):
        m = json.loads(f.read_text())["meta"]["metrics"]
        kept += m["train/num_kept_groups"]
        seen += m["train/num_groups"]
    return (1 - kept / seen if seen else float("nan")), seen


def val_acc(row: dict) -> float | None:
    """The held-out accuracy of a metrics row (the first `val-core/*/acc/mean@*` key), or None."""
    for k, v in row.items():
        if k.startswith("val-core/") and "/acc/mean@" in k:
            return float(v)
    return None


def run_variant(name: str, extra: list[str], args, tmp: Path, train_file: Path) -> dict:
    """Train one variant; return its summary."""
    from dapo_core.config import load_config, to_yaml
    from flows.dapo_train import dapo_train

    run_id = f"sampler-{name}"
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu.yaml",
        [
            f"data.train_files=[{train_file}]",
            f"data.val_files=[{ROOT / 'data' / 'val.parquet'}]",
            f"trainer.models_dir={ROOT / 'models'}",
            f"trainer.runs_dir={tmp / 'runs'}",
            "trainer.use_ray=false",
            "trainer.val_before_train=true",
            f"trainer.test_freq={args.test_freq}",
            "trainer.save_freq=-1",
            "trainer.logger=[jsonl]",
            f"trainer.total_training_steps={args.steps}",
            f"trainer.experiment_name={run_id}",
            *extra,
        ],
    )
    dapo_train(to_yaml(cfg), run_id)
    run = tmp / "runs" / run_id
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing_s/step" in r]
    accs = [(r["step"], val_acc(r)) for r in rows if val_acc(r) is not None]
    minutes = sum(r["timing_s/step"] for r in steps) / 60
    share, groups = zero_spread_share(run)
    return {
        "zero_spread_share": share,
        "groups_per_step": groups / max(len(steps), 1),
        "acc_before": accs[0][1],
        "acc_after": accs[-1][1],
        "train_minutes": minutes,
        "acc_gain_per_minute": (accs[-1][1] - accs[0][1]) / minutes if minutes else float("nan"),
        "val_curve": accs,
    }


def main(argv: list[str] | None = None) -> None:
    """Run both variants and print one table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--train-rows", type=int, default=160)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--explore-prob", type=float, default=0.1)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    import pyarrow.parquet as pq

    tmp = Path(tempfile.mkdtemp(prefix="dapo-sampler-"))
    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    train_file = tmp / "train_subset.parquet"
    pq.write_table(pq.read_table(ROOT / "data" / "train.parquet").slice(0, args.train_rows), train_file)
    hist = [
        "data.history_sampler.enable=true",
        f"data.history_sampler.window={args.window}",
        f"data.history_sampler.explore_prob={args.explore_prob}",
    ]
    res = {
        name: run_variant(name, ov, args, tmp, train_file)
        for name, ov in (("off", ["data.history_sampler.enable=false"]), ("history", hist))
    }
    print(f"{args.steps} steps, {args.train_rows} training prompts, one seed (trainer.seed=1)")
    print(
        "| sampler | zero-spread groups generated | groups / step | held-out acc before → after | "
        "training minutes | acc gain / minute |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(
            f"| {name} | {100 * r['zero_spread_share']:.1f} % | {r['groups_per_step']:.1f} | "
            f"{100 * r['acc_before']:.1f} % → {100 * r['acc_after']:.1f} % | {r['train_minutes']:.2f} | "
            f"{100 * r['acc_gain_per_minute']:.2f} pt |"
        )
    for name, r in res.items():
        print(name, "val curve (step, acc):", [(s, round(a, 3)) for s, a in r["val_curve"]])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
