"""dapo-pipeline: the main job (`make train`): prepare data → base model → evaluate → DAPO → evaluate.

On the CPU default it runs end to end with an ephemeral Prefect API and a local Ray, and prints the held-out
accuracy before and after DAPO, the wall time, and where every artefact went.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from prefect import flow

from dapo_core.config import load_config_text, typed
from flows.base_model import base_model_flow
from flows.dapo_train import dapo_train
from flows.evaluate import evaluate_flow
from flows.prepare_data import prepare_data_flow


def headline_accuracy(metrics: dict) -> float | None:
    """The `val-core/<source>/acc/mean@k` value (first data source), or None."""
    vals = [v for k, v in sorted(metrics.items()) if k.startswith("val-core/") and "/acc/mean@" in k]
    return vals[0] if vals else None


@flow(name="dapo-pipeline", log_prints=True)
def pipeline(cfg_yaml: str, run_id: str) -> dict:
    """Run the whole job; returns before/after accuracy and paths."""
    t0 = time.perf_counter()
    cfg = typed(load_config_text(cfg_yaml))
    stats = prepare_data_flow(cfg_yaml)
    model_path = base_model_flow(cfg_yaml)
    run_dir = Path(cfg.trainer.runs_dir) / run_id
    before = evaluate_flow(cfg_yaml, model_path, output=str(run_dir / "eval_before.json"))
    t_train = time.perf_counter()
    result = dapo_train(cfg_yaml, run_id)
    train_s = time.perf_counter() - t_train
    final = export_final(run_dir, Path(cfg.trainer.models_dir) / "dapo_final")
    after = evaluate_flow(cfg_yaml, str(final), output=cfg.eval.output)
    acc0, acc1 = headline_accuracy(before), headline_accuracy(after)
    wall = time.perf_counter() - t0
    summary = {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "base_model": model_path,
        "final_model": str(final),
        "data": stats,
        "accuracy_before": acc0,
        "accuracy_after": acc1,
        "train_steps": result["train_step"],
        "gen_steps": result["gen_step"],
        "train_wall_s": train_s,
        "total_wall_s": wall,
    }
    lines = [
        "",
        "=" * 72,
        (
            f"DAPO run {run_id} finished in {wall / 60:.1f} min (training {train_s / 60:.1f} min, "
            f"{result['train_step']} train steps, {result['gen_step']} generation batches)"
        ),
        f"held-out accuracy (mean@{cfg.eval.n}): before {_pct(acc0)}  ->  after {_pct(acc1)}"
        + (f"   ({(acc1 - acc0) * 100:+.1f} points)" if acc0 is not None and acc1 is not None else ""),
        f"data:        {', '.join(st['path'] for st in stats.values())}",
        f"base model:  {model_path}",
        f"run store:   {run_dir}  (metrics.jsonl, tensorboard/, curves.png, ckpt/)",
        f"final model: {final}  (HF folder; `dvc repro evaluate` scores it)",
        f"evaluation:  {run_dir / 'eval_before.json'}  and  {cfg.eval.output}",
        "=" * 72,
    ]
    print("\n".join(lines))
    return summary


def export_final(run_dir: Path, out: Path) -> Path:
    """Copy the latest checkpoint's policy (HF weights, config, tokenizer; no optimizer state) to `out`."""
    from dapo_core.store.checkpoint import CheckpointDir

    ckpts = CheckpointDir(run_dir)
    step = ckpts.latest_step()
    if step is None:
        raise RuntimeError(
            f"{run_dir} has no checkpoint: set trainer.save_freq > 0 so the final step is saved"
        )
    src = Path(ckpts.load(step)) / "actor"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("optim.*", "extra_state.*", "deepspeed"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"
