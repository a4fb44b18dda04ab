"""dapo-train: the DAPO step loop as a Prefect flow, in the synchronous (reference `fit`) order.

    for each train step:
        generate → reward → filter_groups  ⟲ until train_batch_size informative groups (dynamic sampling)
        → old_log_prob → [ref] → [values] → advantage → [update_critic] → update_actor → sync_weights
        → [checkpoint every save_freq] → [validate every test_freq] → log

Every stage is a Prefect task (tasks/) that commits its output to the run store `runs/<run_id>/`; tasks take
the run's `Runtime` and URIs, never batches; models live in long-lived workers. Resume = run the
flow again with the same run id (`trainer.resume_mode=auto`). Parameters (a deployment run's fields in the
Prefect UI): `config` (a name in `configs/`, a path, or resolved YAML text), `overrides` (dotted
`key=value`), `run_id` (empty for a new run named after the flow run, or a run to resume). `gen_step`
counts generation batches (it seeds sampling), `train_step` policy updates (the lr schedule and
`total_training_steps` follow it, unlike the reference). A worker that dies or hangs mid-step restarts the
run's workers from the last checkpoint while `trainer.max_restarts` allows (`flows.restarts`).
docs/ARCHITECTURE.md has the details.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from prefect import flow, get_run_logger

from dapo_core.config import (
    ConfigError,
    DapoConfig,
    gen_batch_size,
    load_config,
    load_config_text,
    runs_ahead,
    typed,
)
from dapo_core.preflight import preflight
from dapo_core.stages import DynamicSamplingExhausted, exhausted_message
from flows.artifacts import RunArtifacts
from flows.learn import learn
from flows.progress import quiet_worker_noise
from flows.replay_order import replay_train_step
from flows.restarts import Restarts
from flows.run_setup import DriverState, TrainRun, close_run, open_run, restore
from flows.step_support import add_metrics, observe_rewards, refill_size, step_metrics
from flows.ui_state import crash_orphaned_task_runs, quiet_task_run_console
from tasks.rollout import generate, reward
from tasks.update import checkpoint, sync_weights
from tasks.validate import validate


def collect_batch(rt: TrainRun, step: int, state: DriverState) -> tuple[str, dict]:
    """Dynamic sampling (docs/REFERENCE.md §6.1): generate, score and filter until `train_batch_size` groups
    are kept."""
    fg, keep_rate = rt.cfg.algorithm.filter_groups, rt.keep_rate
    need = rt.cfg.data.train_batch_size
    kept_uris: list[str] = []
    kept_groups, k = 0, 0
    metrics: dict[str, float] = {}
    batch: tuple[str, dict[str, float]] | None = None
    while batch is None:
        # gen_batch_size prompts (refill=adaptive: sized to the deficit and the run-wide keep rate)
        size = refill_size(rt.cfg, keep_rate, need - kept_groups, fixed=gen_batch_size(rt.cfg))
        rt.progress.stage(f"generate g{k} ({size} prompts)")
        state.gen_step += 1
        gen_uri, m = generate(rt, step, k, state.gen_step, size)  # draws its prompts (stage prompts_g<k>)
        add_metrics(metrics, m)
        rt.progress.stage(f"reward g{k}")
        # scores, filters (dynamic sampling) and, once the kept groups cover the deficit, assembles the batch
        scored = reward(rt, step, k, gen_uri, kept_uris, need - kept_groups)
        add_metrics(metrics, scored.metrics)
        add_metrics(metrics, observe_rewards(rt, scored.uri))  # data.history_sampler only
        k += 1
        kept_uris.append(scored.kept_uri)
        batch = scored.batch
        if not fg.enable:
            rt.progress.gen_batch(k - 1, size, None, need)
            break
        kept = int(scored.kept_metrics["train/num_kept_groups"])
        kept_groups += kept
        keep_rate.update(kept, int(scored.kept_metrics["train/num_groups"]))
        rt.progress.gen_batch(k - 1, size, kept_groups, need)  # a bar on a terminal, else rate-limited lines
        if batch is None and fg.max_num_gen_batches > 0 and k >= fg.max_num_gen_batches:
            raise DynamicSamplingExhausted(exhausted_message(k, fg.max_num_gen_batches, kept_groups, need))
    assert batch is not None  # the loop ends with an assembled batch or raises
    batch_uri, m = batch
    metrics.update(m)
    metrics["train/keep_rate"] = keep_rate.rate if fg.enable and keep_rate.rate is not None else 1.0
    metrics["train/num_kept_groups"] = float(kept_groups if fg.enable else need)  # the step's, all batches
    return batch_uri, metrics


def train_step(rt: TrainRun, step: int, state: DriverState) -> dict:
    """One DAPO training step; returns its metrics."""
    t0 = time.perf_counter()
    uri, metrics = collect_batch(rt, step, state)
    adv_uri, stage_metrics = learn(rt, step, uri)
    for m in stage_metrics:
        metrics.update(m)
    if step > rt.cfg.trainer.critic_warmup:  # the actor was updated: the rollout gets the next version
        rt.progress.stage("sync weights")
        metrics.update(sync_weights(rt, step, state.weight_version + 1))
        state.weight_version += 1
    metrics["timing_s/step"] = time.perf_counter() - t0
    metrics.update(step_metrics(rt, step, adv_uri, metrics))
    return metrics


CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
"""Where a bare config name (`tiny_cpu`) is looked up."""


def resolve_config(config: str, overrides: list[str] | None = None) -> DapoConfig:
    """The typed config from `config` (resolved YAML text, a path, or a name in `configs/`) and `overrides`.

    A name that is neither an existing file nor in `configs/` is a ConfigError listing the configs there."""
    ov = list(overrides or [])
    if "\n" in config:
        return typed(load_config_text(config, ov))
    path = Path(config)
    if not path.exists():
        named = CONFIGS_DIR / (config if config.endswith((".yaml", ".yml")) else f"{config}.yaml")
        if not named.exists():
            known = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
            raise ConfigError(
                f"config={config!r}: no such file, and no configs/{named.name}; give a path to a YAML "
                f"config or one of the names in configs/: {known}"
            )
        path = named
    return typed(load_config(path, ov))


def default_run_id() -> str:
    """A new run id for a run started without one: the Prefect flow run's name and id prefix (stable across
    retries of that flow run, so Retry continues the run); `run-<8 hex>` when called outside a flow run."""
    from prefect.runtime import flow_run

    if flow_run.id:
        return f"{flow_run.name}-{str(flow_run.id)[:8]}"
    return f"run-{uuid.uuid4().hex[:8]}"


@flow(name="dapo-train", log_prints=True)
def dapo_train(config: str = "tiny_cpu", run_id: str = "", overrides: list[str] | None = None) -> dict:
    """Train with DAPO under `run_id` (resumes it if it exists and `trainer.resume_mode` allows; empty: a new
    run). `config`: a name in configs/, a path, or resolved YAML; `overrides`: dotted `key=value` items."""
    quiet_worker_noise()
    quiet_task_run_console()  # the runner's flow-run process: as quiet as the CLI
    cfg = resolve_config(config, overrides)
    run_id = run_id or cfg.trainer.experiment_name or default_run_id()
    cfg.trainer.experiment_name = run_id
    tr = cfg.trainer
    logger = get_run_logger()
    preflight(cfg, phase="train")  # data rows, model folder, store, disk: before any worker starts
    rt = open_run(cfg, run_id)
    ui: RunArtifacts | None = None
    try:
        if crashed := crash_orphaned_task_runs(rt.store):  # before this attempt starts a task
            logger.info("marked %d task run(s) of an earlier, dead attempt Crashed", crashed)
        state = restore(rt)
        total = state.total_steps
        logger.info(
            "run %s: train_step=%d gen_step=%d of %d steps; store %s",
            run_id,
            state.train_step,
            state.gen_step,
            total,
            rt.store.root,
        )
        ui = RunArtifacts(run_id, rt.store.root, total, state.train_step)
        if tr.val_before_train and state.train_step == 0:
            rt.progress.stage("validate (before training)")
            val0 = validate(rt, 0, state.gen_step)[1]
            rt.tracker.log(0, val0)
            ui.validation(0, val0)
        step_fn = replay_train_step if runs_ahead(cfg) else train_step
        restarts = Restarts(rt, ui, logger)
        while state.train_step < total:
            step = state.train_step + 1
            rt.progress.begin_step(step, total)
            try:
                metrics = step_fn(rt, step, state)
                state.train_step = step
                last = step == total
                if tr.test_freq > 0 and (step % tr.test_freq == 0 or last):
                    rt.progress.stage("validate")
                    metrics.update(validate(rt, step, state.gen_step)[1])
                metrics.update(
                    {
                        "training/global_step": step,
                        "training/gen_step": state.gen_step,
                        "training/epoch": rt.sampler.epoch,
                        **restarts.metrics(),
                    }
                )
                rt.tracker.log(step, metrics)  # before the checkpoint: a resumed run misses no step's row
                if tr.save_freq > 0 and (step % tr.save_freq == 0 or last):
                    rt.progress.stage("checkpoint")
                    checkpoint(rt, step, state.to_json(rt))
            except Exception as exc:  # a dead or hung worker: new ones resume from the last checkpoint
                state = restarts.recover(rt, step, exc)  # raises when it is no such fault or none is left
                continue
            rt.progress.end_step(metrics)
            ui.step(step, metrics)
            if "console" not in tr.logger:  # the console logger prints the step's line
                took = metrics["timing_s/step"]
                logger.info("step %d (gen_step %d) done in %.1fs", step, state.gen_step, took)
    finally:
        close_run(rt)  # draws curves.png
        if ui is not None:
            ui.close()  # what was queued for the UI is published, also when the run failed
    assert ui is not None
    ui.summary(state.train_step, final=True)
    return {
        "run_id": run_id,
        "train_step": state.train_step,
        "gen_step": state.gen_step,
        "run_dir": str(rt.store.root),
    }
