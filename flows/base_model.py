"""dapo-base-model: build the embedded tiny Qwen2 model and warm it up with a short supervised phase.

A randomly initialised model scores nothing and gives DAPO no signal (every group has zero reward spread and
dynamic sampling drops it), so the CPU default starts from a model fine-tuned for a few hundred steps on
worked solutions of the synthetic training problems. The result is an ordinary HF folder
(`models/tiny_base/`).

`actor_rollout_ref.model.sft.answer_line_prob` < 1 makes the warm-up imitate a common failure of instruction
models: the worked line is right but the final `Answer: <n>` line the verifier needs is often left out. The
base model then scores low although it can add, and DAPO has to discover from the reward alone that the answer
line pays (the `val-aux/<source>/format/answer_line_rate` metric shows that part of the gain separately).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger, task

from dapo_core.compute.models import build_tiny_model, load_tokenizer
from dapo_core.compute.numerics import torch_numerics
from dapo_core.compute.sft import answer_line_solution, warmup_sft
from dapo_core.config import DapoConfig, load_config_text, typed
from dapo_core.data.datasets import read_parquet
from flows.progress import Ticker


@task(name="build_tiny_model")
def build(cfg_yaml: str, out_dir: str) -> str:
    """Random-init tiny model + char tokenizer as an HF folder."""
    tiny = typed(load_config_text(cfg_yaml)).actor_rollout_ref.model.tiny
    return str(build_tiny_model(out_dir, asdict(tiny), seed=tiny.seed))


@task(name="sft_warmup")
def sft(cfg_yaml: str, model_dir: str) -> dict:
    """Supervised warm-up on synthetic worked solutions (saved back into `model_dir`)."""
    cfg = typed(load_config_text(cfg_yaml))
    s = cfg.actor_rollout_ref.model.sft
    rows = read_parquet(cfg.data.train_files[0]).to_pylist()
    tr = cfg.trainer  # threads and deterministic algorithms from the config, never from the environment
    with (
        torch_numerics(tr.num_threads, tr.deterministic),
        Ticker("SFT warm-up", s.steps, "steps") as bar,  # a bar on a terminal, else a line every 15 s
    ):
        return warmup_sft(
            model_dir,
            rows,
            load_tokenizer(model_dir),
            steps=s.steps,
            lr=s.lr,
            batch_size=s.batch_size,
            seed=s.seed,
            solution_fn=functools.partial(
                answer_line_solution, answer_line_prob=s.answer_line_prob, seed=s.seed
            ),
            on_step=lambda done, loss: bar.update(done, f"loss {loss:.3f}"),
        )


@flow(name="dapo-base-model", log_prints=True)
def base_model_flow(cfg_yaml: str) -> str:
    """Build (and warm up) the tiny base model unless `actor_rollout_ref.model.path` names a model."""
    cfg = typed(load_config_text(cfg_yaml))
    logger = get_run_logger()
    if cfg.actor_rollout_ref.model.path:
        logger.info("using the model at %s", cfg.actor_rollout_ref.model.path)
        return cfg.actor_rollout_ref.model.path
    out = Path(cfg.trainer.models_dir) / "tiny_base"
    recipe = _recipe(cfg)
    stamp = out / "base_model_recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        logger.info("reusing %s (built from the same tiny/sft/data settings)", out)
        return str(out)
    stamp.unlink(missing_ok=True)
    logger.info("building the tiny base model -> %s", out)
    path = build(cfg_yaml, str(out))
    if cfg.actor_rollout_ref.model.sft.enable:
        logger.info("SFT warm-up: %d steps", cfg.actor_rollout_ref.model.sft.steps)
        metrics = sft(cfg_yaml, path)
        logger.info(
            "SFT warm-up: loss %.3f -> %.3f in %.0fs",
            metrics["loss_first"],
            metrics["loss_last"],
            metrics["wall_s"],
        )
    stamp.write_text(json.dumps(recipe, sort_keys=True))  # written last: a crashed build is rebuilt
    return path


def _recipe(cfg: DapoConfig) -> dict:
    """Everything the base model depends on (model sizes, warm-up settings, training data, and the threads
    and deterministic algorithms the warm-up's numbers depend on)."""
    files = cfg.data.train_files
    return {
        "numerics": {"num_threads": cfg.trainer.num_threads, "deterministic": cfg.trainer.deterministic},
        "tiny": asdict(cfg.actor_rollout_ref.model.tiny),
        "sft": asdict(cfg.actor_rollout_ref.model.sft),
        "synthetic": asdict(cfg.data.synthetic),
        "train_files": {f: (Path(f).stat().st_size if Path(f).exists() else None) for f in files},
    }
