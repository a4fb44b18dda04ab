"""dapo-pipeline: the main job (`make train`): prepare data → base model → evaluate → DAPO → evaluate.

On the CPU default it runs end to end with an ephemeral Prefect API and a local Ray, and prints the held-out
accuracy before and after DAPO, the wall time, and where every artefact went.

`python -m flows.pipeline dvc-train --config params.yaml --milestones 50,100` is the `train` stage of
`dvc.yaml`: it trains under a run id derived from the training parameters (`dvc-<hash>`; the run store stays
outside DVC, so an interrupted `dvc repro` resumes it), then exports the DVC outputs: the final policy
(`models/dapo_final`), the milestone checkpoints (`models/checkpoints/step_<n>`, policy weights only),
`metrics/train.json` (final-step metrics) and `metrics/train_curves.csv` (the curves `dvc plots show` draws).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf
from prefect import flow

from dapo_core.config import load_config, load_config_text, to_safe_yaml, typed
from dapo_core.errors import DapoUserError
from dapo_core.preflight import check_writable
from flows.base_model import base_model_flow
from flows.dapo_train import dapo_train
from flows.evaluate import evaluate_flow
from flows.prepare_data import prepare_data_flow
from flows.progress import prefect_console_env, quiet_worker_noise, start_local_prefect
from flows.run_guard import (
    debug_enabled,
    load_config_reported,
    quiet_user_error_tracebacks,
    run_reported,
    train_checks,
)


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
    greedy_yaml = greedy_config(cfg_yaml) if cfg.eval.greedy else None
    if greedy_yaml:
        before_g = evaluate_flow(greedy_yaml, model_path, output=str(run_dir / "eval_before_greedy.json"))
    t_train = time.perf_counter()
    result = dapo_train(cfg_yaml, run_id)
    train_s = time.perf_counter() - t_train
    final = export_final(run_dir, Path(cfg.trainer.models_dir) / "dapo_final")
    after = evaluate_flow(cfg_yaml, str(final), output=cfg.eval.output)
    extra: list[str] = []
    if greedy_yaml:
        after_g = evaluate_flow(greedy_yaml, str(final), output=str(run_dir / "eval_after_greedy.json"))
        extra = comparison_lines(before, after, before_g, after_g)
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
        *extra,
        f"data:        {', '.join(st['path'] for st in stats.values())}",
        f"base model:  {model_path}",
        f"run store:   {run_dir}  (metrics.jsonl, tensorboard/, curves.png, ckpt/)",
        f"final model: {final}  (HF folder; `dvc repro evaluate` scores it)",
        f"evaluation:  {run_dir / 'eval_before.json'}  and  {cfg.eval.output}",
        "=" * 72,
    ]
    print("\n".join(lines))
    return summary


def greedy_config(cfg_yaml: str) -> str:
    """The same config with greedy evaluation (`eval.temperature=0`, `eval.n=1`)."""
    cfg = load_config_text(cfg_yaml)
    cfg.eval.temperature, cfg.eval.n = 0.0, 1
    return to_safe_yaml(cfg)


def _first(metrics: dict, part: str) -> float | None:
    vals = [v for k, v in sorted(metrics.items()) if part in k]
    return vals[0] if vals else None


def comparison_lines(before: dict, after: dict, before_g: dict, after_g: dict) -> list[str]:
    """Greedy accuracy before -> after, and for both evaluations the share of answers that parse (an
    `Answer:` line or a box) and the accuracy among those, so a gain in format is told apart from one in
    arithmetic. The standard error of a greedy accuracy p on N prompts is sqrt(p(1-p)/N)."""
    lines = []
    g0, g1 = headline_accuracy(before_g), headline_accuracy(after_g)
    n = _first(before_g, "eval/num_prompts") or 0
    se = [((p * (1 - p) / n) ** 0.5 if p is not None and n else None) for p in (g0, g1)]
    lines.append(
        f"held-out accuracy (greedy):  before {_pct(g0)}  ->  after {_pct(g1)}"
        + (f"   (±1 SE {_pct(se[0])} / {_pct(se[1])})" if se[0] is not None and se[1] is not None else "")
    )
    for name, m0, m1 in (("mean@k", before, after), ("greedy", before_g, after_g)):
        parts = []
        for m in (m0, m1):
            rate, acc = _first(m, "/format/answer_line_rate"), headline_accuracy(m)
            among = acc / rate if rate and acc is not None else None
            parts.append(f"parse {_pct(rate)}, accuracy among parsed {_pct(among)}")
        lines.append(f"answers ({name}): before {parts[0]}  ->  after {parts[1]}")
    return lines


def export_final(run_dir: Path, out: Path) -> Path:
    """Copy the latest checkpoint's policy (HF weights, config, tokenizer; no optimizer state) to `out`
    (`_copy_policy`)."""
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
    _copy_policy(src, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


# ------------------------------------------------------------------------------------- the DVC train stage
def dvc_run_id(cfg_yaml: str) -> str:
    """`trainer.experiment_name`, or `dvc-<hash>` of every parameter but `eval.*` (evaluation settings do
    not change the training run, so changing them re-runs only `evaluate`)."""
    cfg = load_config_text(cfg_yaml)
    if cfg.trainer.experiment_name:
        return str(cfg.trainer.experiment_name)
    tree = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(tree, dict)
    tree.pop("eval", None)
    return "dvc-" + hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:10]


def export_milestones(run_dir: Path, steps: list[int], out: Path, save_freq: int) -> list[Path]:
    """Copy the policy of checkpoints `steps` to `out/step_<n>` (the folder is replaced: exactly these)."""
    from dapo_core.store.checkpoint import CheckpointDir

    ckpts = CheckpointDir(run_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    done = []
    for step in steps:
        src = ckpts.path(step) / "actor"
        if not src.is_dir():
            raise DapoUserError(
                f"--milestones: run {run_dir.name} has no checkpoint of step {step} (trainer.save_freq="
                f"{save_freq} saves every save_freq steps and the last)",
                where=str(ckpts.path(step)),
                fix="choose saved steps in dvc.yaml's `milestones`, or change trainer.save_freq in "
                "params.yaml",
            )
        dst = out / f"step_{step}"
        _copy_policy(src, dst)
        done.append(dst)
    return done


def _copy_policy(src: Path, dst: Path) -> None:
    """The policy of the checkpoint folder `src` as an HF model folder at `dst`: its weights, config and
    tokenizer (no optimizer or engine state), or for a LoRA checkpoint its adapter merged into the base
    (`dapo_core.compute.lora_checkpoint.merge_into`)."""
    from dapo_core.compute.lora_checkpoint import is_adapter_folder, merge_into

    if is_adapter_folder(src):
        merge_into(src, dst)
        return
    skip = shutil.ignore_patterns("optim.*", "extra_state.*", "deepspeed", "model.rank*", "fsdp2.json")
    shutil.copytree(src, dst, ignore=skip)


def write_train_metrics(run_dir: Path, summary: dict, metrics_dir: Path) -> None:
    """`metrics/train.json` (the last step's key metrics) and `metrics/train_curves.csv` (one row per step)
    from the run's `metrics.jsonl`."""
    from dapo_core.metrics.tracking import read_jsonl
    from flows.artifacts import STEP_COLUMNS, step_row

    rows = [step_row(int(r["step"]), r) for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
    metrics_dir.mkdir(parents=True, exist_ok=True)
    cols = ["step", *(c for c, _ in STEP_COLUMNS), "val_acc"]
    with open(metrics_dir / "train_curves.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    last = rows[-1] if rows else {}
    vals = [r["val_acc"] for r in rows if r.get("val_acc") is not None]
    out = {
        "run_id": summary["run_id"],
        "train_steps": summary["train_step"],
        "gen_steps": summary["gen_step"],
        "final": {k: v for k, v in last.items() if k != "step" and v is not None},
        "val_acc_last": vals[-1] if vals else None,
    }
    (metrics_dir / "train.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


def dvc_train(
    config: str, milestones: list[int], models_dir: Path, metrics_dir: Path, *, cfg_yaml: str | None = None
) -> dict:
    """The `train` stage of dvc.yaml: train (or resume) the run of these parameters, export its outputs
    (`cfg_yaml`: the config already loaded from `config`)."""
    from flows.dapo_train import dapo_train

    cfg_yaml = cfg_yaml or to_safe_yaml(load_config(config))
    run_id = dvc_run_id(cfg_yaml)
    print(
        f"dvc train: run id {run_id} (runs/ stays outside DVC; an interrupted repro resumes it)", flush=True
    )
    summary = dapo_train(cfg_yaml, run_id)
    cfg = typed(load_config_text(cfg_yaml))
    run_dir = Path(summary["run_dir"])
    export_final(run_dir, models_dir / "dapo_final")
    export_milestones(run_dir, milestones, models_dir / "checkpoints", cfg.trainer.save_freq)
    write_train_metrics(run_dir, summary, metrics_dir)
    return summary


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.pipeline dvc-train --config params.yaml --milestones 50,100` (dvc.yaml's train):
    the checks of `dapo train --flow-only` (config, memory plan, preflight, the run's lease) before the
    temporary Prefect server starts, and every ending as one paragraph (`flows.run_guard.run_reported`)."""
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__.split("\n\n")[2])
    parser.add_argument("command", choices=["dvc-train"])
    parser.add_argument("--config", default="params.yaml")
    parser.add_argument("--milestones", default="", help="comma-separated train steps to export")
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--metrics-dir", default="metrics")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks (also DAPO_DEBUG=1)")
    args = parser.parse_args(argv)
    if os.environ.get("DAPO_TASK_LOGS") != "1":  # one line per task run is Prefect's default: too many here
        logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    prefect_console_env()  # as the dapo CLI: usage data off unless asked for (prefect is imported already)
    state: dict = {}
    return run_reported(
        args.command,
        lambda: _dvc_main(args, state),
        debug=debug_enabled(args.debug),
        state=state,
        resume=lambda: f"dvc repro train (it resumes run {state['run_id']})",
    )


def _milestones(text: str) -> list[int]:
    """`--milestones 10,30` as train steps."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DapoUserError(
            f"--milestones {text!r} is not a comma-separated list of train steps",
            where="dvc.yaml `milestones` (vars)",
            fix="write saved train steps such as 10,30",
        ) from None


def _dvc_main(args: argparse.Namespace, state: dict) -> int:
    """The DVC train stage after argument parsing (`main` adds the reporting and signal handling)."""
    steps = _milestones(args.milestones)
    cfg = load_config_reported(args.config, [], args.command)
    cfg_yaml = to_safe_yaml(cfg)
    run_id = dvc_run_id(cfg_yaml)
    tcfg = typed(cfg)
    tcfg.trainer.experiment_name = run_id  # the run the stage writes: its lease is checked too
    state["run_id"] = run_id
    state["run_dir"] = Path(tcfg.trainer.runs_dir) / run_id
    code = train_checks(tcfg, flow_only=True)
    if code:
        return code
    for folder, key in ((args.models_dir, "--models-dir"), (args.metrics_dir, "--metrics-dir")):
        check_writable(folder, key=f"{key} (the train stage's outputs)")  # written after training
    quiet_user_error_tracebacks(debug_enabled(args.debug))
    quiet_worker_noise()
    start_local_prefect(args.command)  # Prefect's own 20 s start-up timeout fails on a loaded machine
    dvc_train(args.config, steps, Path(args.models_dir), Path(args.metrics_dir), cfg_yaml=cfg_yaml)
    return 0


if __name__ == "__main__":
    sys.exit(main())
