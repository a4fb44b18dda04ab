"""Dynamic sampling on the real flow: fixed generation batches (reference) vs adaptive refills, same data and
model.

Builds the CPU default's data and warmed-up base model once (in --root), then runs the real `dapo-train` flow
(in-process workers, ephemeral Prefect) twice for --steps steps from that same base model, with
`algorithm.filter_groups.refill=fixed` and `=adaptive`, and reports per step: kept groups thrown away as
surplus (`train/discarded_surplus_groups`), prompts generated, generation batches, and the step time.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_refill_flow.py [--steps 20] [--root /tmp/refill_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--root", default="/tmp/refill_bench")
    ap.add_argument("--gen-batch-size", type=int, default=32)
    args = ap.parse_args()
    (Path(args.root) / "prefect").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(Path(args.root) / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

    from dapo_core.config import load_config, to_yaml
    from dapo_core.store import RunStore
    from flows.base_model import base_model_flow
    from flows.dapo_train import dapo_train
    from flows.prepare_data import prepare_data_flow

    root = Path(args.root)
    common = [
        f"data.synthetic.out_dir={root / 'data'}",
        f"data.train_files=[{root / 'data' / 'train.parquet'}]",
        f"data.val_files=[{root / 'data' / 'val.parquet'}]",
        f"trainer.models_dir={root / 'models'}",
        f"trainer.runs_dir={root / 'runs'}",
        "trainer.use_ray=false",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.total_training_steps={args.steps}",
        f"data.gen_batch_size={args.gen_batch_size}",
    ]
    cfg0 = load_config(ROOT / "configs" / "tiny_cpu.yaml", common)
    if not (root / "models" / "tiny_base" / "model.safetensors").exists():
        prepare_data_flow(to_yaml(cfg0))
        base_model_flow(to_yaml(cfg0))
    results = {}
    for mode in ("fixed", "adaptive"):
        run_id = f"refill-{mode}-{args.steps}"
        shutil.rmtree(root / "runs" / run_id, ignore_errors=True)
        cfg = load_config(
            ROOT / "configs" / "tiny_cpu.yaml",
            [
                *common,
                f"algorithm.filter_groups.refill={mode}",
                f"trainer.experiment_name={run_id}",
                "trainer.resume_mode=disable",
            ],
        )
        dapo_train(to_yaml(cfg), run_id)
        rows = [json.loads(x) for x in (root / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
        store = RunStore(root / "runs" / run_id)
        prompts = sum(
            store.read_stage(s, st).num_rows // int(cfg.actor_rollout_ref.rollout.n)
            for s in store.steps()
            for st in store.committed_stages(s)
            if st.startswith("prompts_g")
        )
        n = len(rows)
        results[mode] = {
            "surplus_groups_per_step": sum(r.get("train/discarded_surplus_groups", 0) for r in rows) / n,
            "prompts_per_step": prompts / n,
            "gen_batches_per_step": sum(r.get("train/num_gen_batches", 0) for r in rows) / n,
            "step_s_median": sorted(r["timing_s/step"] for r in rows)[n // 2],
            "final_keep_rate": rows[-1].get("train/keep_rate"),
        }
    header = ("surplus groups/step", 22), ("prompts/step", 14), ("gen batches/step", 18), ("step s (med)", 14)
    print(f"{'mode':<10}" + "".join(f"{name:>{width}}" for name, width in header))
    for mode, r in results.items():
        print(
            f"{mode:<10}{r['surplus_groups_per_step']:>22.2f}{r['prompts_per_step']:>14.1f}"
            f"{r['gen_batches_per_step']:>18.2f}{r['step_s_median']:>14.2f}"
        )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
