"""dapo-evaluate: score a model on held-out parquet files with k samples per prompt.

Writes `eval.output` (default `metrics/eval.json`) with mean@k, pass@k, maj@k (and best@k, std@k) per data
source. The checkpoint may be an HF folder, a run checkpoint `runs/<id>/ckpt/step_<n>` (its `actor/` weights,
or a LoRA run's adapter merged into its base) or a run folder (its latest checkpoint). Sampling follows
`eval.{n,temperature,top_p,top_k}`; the reproduction configs use the reference's AIME settings (temperature
1.0, top_p 0.7).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import flow, get_run_logger, task

from dapo_core.compute.models import load_tokenizer
from dapo_core.compute.numerics import torch_numerics
from dapo_core.compute.workers import RewardWorker, RolloutWorker
from dapo_core.config import load_config_text, resolve_device, typed
from dapo_core.data import batch as B
from dapo_core.metrics.validation import validation_summary
from dapo_core.seeding import uid_factory
from flows.artifacts import publish_eval
from flows.progress import Ticker


def resolve_checkpoint(path: str) -> str:
    """An HF model folder for `path` (HF folder, run checkpoint step folder, or run folder). A folder inside a
    run checkpoint is verified against the checkpoint's manifest first, whichever of the three is named."""
    from dapo_core.store.checkpoint import CheckpointDir, enclosing_checkpoint, verify_folder

    p = Path(path)
    ckpt = enclosing_checkpoint(p)
    if ckpt is not None:
        verify_folder(ckpt)
    if (p / "config.json").exists():
        return str(p)
    if (p / "actor" / "config.json").exists():
        return str(p / "actor")
    if (p / "ckpt").is_dir():
        step = CheckpointDir(p).resume_step(warn=print, repair=False)
        if step is None:
            raise FileNotFoundError(f"{p} has no checkpoint yet (no ckpt/step_<n>)")
        return resolve_checkpoint(str(CheckpointDir(p).path(step)))  # verified by the call
    raise FileNotFoundError(
        f"{path} is neither an HF model folder, a checkpoint step folder nor a run folder"
    )


def eval_chunks(rows: int, micro_batch: int | None, parts: int = 20) -> list[tuple[int, int]]:
    """Row ranges `[start, stop)` that evaluation generates one after another, so that its progress can be
    shown: about `parts` of them, each a whole number of the engine's micro-batches (`micro_batch` rows,
    HFRolloutEngine's `max_batch_size`), so the engine forms exactly the micro-batches of a single call and,
    with per-row seeds, every sample is the same. One range when the engine has no fixed micro-batch
    (vLLM schedules requests itself)."""
    if not micro_batch or micro_batch < 1 or rows <= micro_batch:
        return [(0, rows)]
    per = max(1, -(-rows // (micro_batch * parts))) * micro_batch
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]


@task(name="evaluate_model")
def evaluate_model(cfg_yaml: str, model_dir: str) -> dict:
    """Generate `eval.n` samples per held-out prompt and summarise the scores. A LoRA checkpoint's adapter
    folder is evaluated as its merged model (`dapo_core.compute.lora_checkpoint.hf_folder`)."""
    from dapo_core.compute.lora_checkpoint import hf_folder

    with hf_folder(model_dir) as folder:
        return _evaluate(cfg_yaml, folder)


def _evaluate(cfg_yaml: str, model_dir: str) -> dict:
    from flows.run_inputs import default_model_path, val_prompts

    cfg = typed(load_config_text(cfg_yaml))
    ev = cfg.eval
    tok_path = (
        model_dir
        if (Path(model_dir) / "tokenizer.json").exists() or (Path(model_dir) / "tokenizer").exists()
        else cfg.actor_rollout_ref.model.tokenizer_path or default_model_path(cfg)
    )
    prompts = val_prompts(cfg.data, load_tokenizer(tok_path), files=ev.files or None)
    sampling = {
        "temperature": ev.temperature,
        "top_p": ev.top_p,
        "top_k": ev.top_k,
        "max_new_tokens": cfg.data.max_response_length,
        "do_sample": ev.temperature > 0,
    }
    rollout = RolloutWorker(
        model_dir,
        engine=cfg.actor_rollout_ref.rollout.name,
        device=resolve_device(cfg),
        seed=cfg.trainer.seed,
        train_sampling=sampling,
        val_sampling=sampling,
        engine_opts=(
            {"max_batch_size": cfg.actor_rollout_ref.rollout.max_num_seqs}
            if cfg.actor_rollout_ref.rollout.name == "hf"
            else {"max_num_seqs": cfg.actor_rollout_ref.rollout.max_num_seqs}
        ),
    )
    reward = RewardWorker(
        tok_path,
        max_resp_len=cfg.data.max_response_length,
        overlong_buffer=None,
        num_workers=cfg.reward_model.num_workers,
        timeout_s=cfg.reward_model.timeout_s,
    )
    try:
        t0 = time.perf_counter()
        table = B.repeat_interleave_prompts(prompts, ev.n, uid_fn=uid_factory(cfg.trainer.seed, "eval"))
        print(
            f"evaluate: generating {prompts.num_rows} prompts x {ev.n} samples with {model_dir}", flush=True
        )
        parts = []
        threads, det = cfg.trainer.num_threads, cfg.trainer.deterministic
        with torch_numerics(threads, det), Ticker("evaluate: generate", table.num_rows, "responses") as bar:
            for start, stop in eval_chunks(table.num_rows, getattr(rollout.engine, "max_batch_size", None)):
                parts.append(rollout.generate(table.slice(start, stop - start), gen_step=0, validate=True))
                bar.update(stop)
        out = B.concat(parts)
        print(f"evaluate: generated {out.num_rows} responses in {time.perf_counter() - t0:.0f}s; scoring")
        out, _ = reward.score(out)
        summary = validation_summary(out)
        summary["eval/time_s"] = time.perf_counter() - t0
        summary["eval/num_prompts"] = float(prompts.num_rows)
        summary["eval/n"] = float(ev.n)
        return summary
    finally:
        rollout.close()
        reward.close()


@flow(name="dapo-evaluate", log_prints=True)
def evaluate_flow(cfg_yaml: str, checkpoint: str = "", output: str = "") -> dict:
    """Evaluate `checkpoint` (or `eval.checkpoint`) and write the metrics JSON; returns the metrics."""
    cfg = typed(load_config_text(cfg_yaml))
    logger = get_run_logger()
    model_dir = resolve_checkpoint(checkpoint or cfg.eval.checkpoint)
    metrics = evaluate_model(cfg_yaml, model_dir)
    out = Path(output or cfg.eval.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"checkpoint": model_dir, "metrics": metrics}, indent=1, sort_keys=True))
    headline = {k: round(v, 4) for k, v in metrics.items() if k.startswith("val-core/") and "/acc/" in k}
    logger.info("evaluated %s -> %s: %s", model_dir, out, headline)
    publish_eval(model_dir, str(out), metrics)  # the UI's view: dapo-eval-<model> table and summary
    return metrics
