"""Setup and cleanup of a training run: config, run store, data samplers, workers, resume state, step metrics.

Plumbing kept out of `flows/dapo_train.py` so that file reads like the algorithm.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from omegaconf import OmegaConf

from dapo_core.algo.dynamic_sampling import KeepRateEstimator
from dapo_core.algo.kl import get_kl_controller
from dapo_core.compute.cluster import Cluster
from dapo_core.compute.models import load_tokenizer
from dapo_core.compute.workers import ActorWorker, CriticWorker, RefWorker, RewardWorker, RolloutWorker
from dapo_core.config import (
    gen_batch_size,
    load_config_text,
    need_reference_policy,
    resolve_device,
    to_yaml,
    use_critic,
)
from dapo_core.data import batch as B
from dapo_core.data.datasets import PromptSampler, read_parquet
from dapo_core.metrics.step import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
from dapo_core.metrics.tracking import Tracker
from dapo_core.store import RunStore
from flows.progress import StepProgress
from tasks import runtime

# Stages of a step that depend only on the weights the step started from: kept on resume and replayed.
ROLLOUT_STAGES = ("prompts_g", "generate_g", "reward_g", "kept_g", "batch", "replay_add_")


def load_cfg(config_yaml: str):
    """Config from resolved YAML text (what the CLI and deployments pass to flows)."""
    return load_config_text(config_yaml)


def default_model_path(cfg) -> str:
    """`actor_rollout_ref.model.path`, or the embedded tiny base model built by the base-model flow."""
    return str(cfg.actor_rollout_ref.model.path or Path(cfg.trainer.models_dir) / "tiny_base")


def _files(value) -> list[str]:
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def read_table(files) -> pa.Table:
    """Concatenate one or several verl parquet files (paths or URLs)."""
    tables = [read_parquet(f) for f in _files(files)]
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]


def val_prompts(cfg, tokenizer) -> pa.Table:
    """All validation prompts, tokenised, in file order."""
    table = read_table(cfg.data.val_files)
    sampler = PromptSampler(
        table,
        tokenizer,
        batch_size=table.num_rows,
        shuffle=False,
        max_prompt_length=int(cfg.data.max_prompt_length),
        truncation=str(cfg.data.truncation),
    )
    return sampler.next_batch()


class ChunkSampler:
    """Draws any number of prompts from a one-prompt-per-batch PromptSampler (refills of any size)."""

    def __init__(self, sampler: PromptSampler):
        self.sampler = sampler

    def next_batch(self, size: int) -> pa.Table:
        return pa.concat_tables([self.sampler.next_batch() for _ in range(int(size))])

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def _plain(node) -> Any:
    return OmegaConf.to_container(node, resolve=True)


def _scheduler_steps(cfg) -> int:
    """Optimizer-schedule length: one lr step per actor update (`parameter_sync_step` per step in replay order)."""
    per_step = int(cfg.trainer.parameter_sync_step) if str(cfg.trainer.step_order) == "replay_buffer" else 1
    return max(int(cfg.trainer.total_training_steps or 1), 1) * per_step


def _create_workers(cfg, cluster: Cluster, model_path: str, tokenizer_path: str, device: str) -> int:
    """Create the run's workers; returns the number of model-holding processes."""
    arr = cfg.actor_rollout_ref
    ro = arr.rollout
    gpu = 1.0 if device == "cuda" else 0.0
    max_new = int(cfg.data.max_response_length)
    train_sampling = {
        "temperature": float(ro.temperature),
        "top_p": float(ro.top_p),
        "top_k": int(ro.top_k),
        "max_new_tokens": max_new,
        "do_sample": bool(ro.do_sample),
    }
    vk = ro.val_kwargs
    val_sampling = {
        "temperature": float(vk.temperature),
        "top_p": float(vk.top_p),
        "top_k": int(vk.top_k),
        "max_new_tokens": max_new,
        "do_sample": bool(vk.do_sample),
    }
    engine_opts = {}
    if str(ro.name) == "vllm":
        engine_opts = {
            "gpu_memory_utilization": float(ro.gpu_memory_utilization),
            "tensor_parallel_size": int(ro.tensor_model_parallel_size),
            "enforce_eager": bool(ro.enforce_eager),
        }
    seed = int(cfg.trainer.seed)
    cluster.create(
        "rollout",
        functools.partial(
            RolloutWorker,
            model_path,
            engine=str(ro.name),
            device=device,
            seed=seed,
            train_sampling=train_sampling,
            val_sampling=val_sampling,
            engine_opts=engine_opts,
        ),
        num_gpus=gpu,
    )
    tok = load_tokenizer(tokenizer_path)
    pad = int(tok.pad_token_id)
    rc = _plain(cfg.algorithm.rollout_correction)
    actor_cfg = _plain(arr.actor)
    if rc.get("bypass_mode"):
        actor_cfg.setdefault("policy_loss", {})["loss_mode"] = "bypass_mode"
    cluster.create(
        "actor",
        functools.partial(
            ActorWorker,
            model_path,
            actor_cfg,
            pad_token_id=pad,
            temperature=float(ro.temperature),
            rollout_n=int(ro.n),
            total_steps=_scheduler_steps(cfg),
            device=device,
            seed=seed,
            log_prob_micro_batch_size=ro.get("log_prob_micro_batch_size_per_gpu"),
            rollout_correction=rc,
        ),
        num_gpus=gpu,
    )
    cluster.create(
        "reward",
        functools.partial(
            RewardWorker,
            tokenizer_path,
            max_resp_len=max_new,
            overlong_buffer=_plain(cfg.reward_model.overlong_buffer),
            num_workers=int(cfg.reward_model.num_workers),
            timeout_s=float(cfg.reward_model.timeout_s),
        ),
    )
    procs = 2
    if need_reference_policy(cfg):
        cluster.create(
            "ref",
            functools.partial(
                RefWorker,
                model_path,
                pad_token_id=pad,
                temperature=float(ro.temperature),
                device=device,
                micro_batch_size=arr.ref.get("log_prob_micro_batch_size_per_gpu"),
            ),
            num_gpus=gpu,
        )
        procs += 1
    if use_critic(cfg):
        critic_cfg = _plain(cfg.critic)
        for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "shuffle"):
            if critic_cfg.get(key) is None:  # verl: unset critic batch settings follow the actor's
                critic_cfg[key] = actor_cfg.get(key)
        cluster.create(
            "critic",
            functools.partial(
                CriticWorker,
                model_path,
                critic_cfg,
                pad_token_id=pad,
                rollout_n=int(ro.n),
                device=device,
                seed=seed,
            ),
            num_gpus=gpu,
        )
        procs += 1
    return procs


def open_run(cfg, run_id: str) -> runtime.Runtime:
    """Open (or create) `runs/<run_id>/`, start the workers, build samplers and register the runtime for tasks."""
    root = Path(cfg.trainer.runs_dir) / run_id
    store = RunStore(root)
    if str(cfg.trainer.resume_mode) == "disable" and (
        store.checkpoints.latest_step() is not None or store.steps()
    ):
        store.close()
        raise RuntimeError(
            f"run {run_id} already has outputs in {root} and trainer.resume_mode=disable: "
            f"choose a new trainer.experiment_name, delete the folder, or set trainer.resume_mode=auto"
        )
    (root / "config.yaml").write_text(to_yaml(cfg))
    model_path = default_model_path(cfg)
    tokenizer_path = str(cfg.actor_rollout_ref.model.tokenizer_path or model_path)
    device = resolve_device(cfg)
    use_ray = bool(cfg.trainer.use_ray)
    cluster = tracker = None
    try:
        tokenizer = load_tokenizer(tokenizer_path)
        # Data first (cheap, and a wrong path should fail before workers spend minutes loading models).
        sampler = ChunkSampler(
            PromptSampler(
                read_table(cfg.data.train_files),
                tokenizer,
                batch_size=1,
                seed=int(cfg.data.seed),
                shuffle=bool(cfg.data.shuffle),
                max_prompt_length=int(cfg.data.max_prompt_length),
                truncation=str(cfg.data.truncation),
            )
        )
        val_table = val_prompts(cfg, tokenizer)
        alg = cfg.algorithm
        kl_ctrl = get_kl_controller(
            str(alg.kl_ctrl.type),
            float(alg.kl_ctrl.kl_coef),
            int(alg.kl_ctrl.horizon),
            float(alg.kl_ctrl.target_kl),
        )
        tracker = Tracker(root, list(cfg.trainer.logger))
        cluster = Cluster(
            run_id,
            use_ray=use_ray,
            address=cfg.trainer.get("ray_address"),
            device=device,
            num_threads=int(os.environ.get("DAPO_WORKER_THREADS", "1")),
        )
        _create_workers(cfg, cluster, model_path, tokenizer_path, device)
        rt = runtime.Runtime(
            run_id=run_id,
            cfg=cfg,
            store=store,
            cluster=cluster,
            pad_token_id=int(tokenizer.pad_token_id),
            vocab_size=len(tokenizer),
            extras={
                "sampler": sampler,
                "val_table": val_table,
                "kl_ctrl": kl_ctrl,
                "keep_rate": KeepRateEstimator(),
                "checkpoints": store.checkpoints,
                "model_path": model_path,
                "tracker": tracker,
                "progress": StepProgress(
                    run_id, enabled=sys.stdout.isatty() or "console" in cfg.trainer.logger
                ),
            },
        )
    except (
        BaseException
    ):  # nothing of a half-opened run may outlive it (Ray actors, a Ray we started, the store)
        if cluster is not None:
            cluster.shutdown()
        if tracker is not None:
            tracker.close()
        store.close()
        raise
    runtime.register(rt)
    return rt


@dataclass
class DriverState:
    """What the driver must remember across a restart (stored in each checkpoint as driver_state.json)."""

    train_step: int = 0
    gen_step: int = 0
    weight_version: int = 0
    total_steps: int = 0
    kl_coef: float = 0.0

    def to_json(self, rt: runtime.Runtime) -> dict:
        d = asdict(self)
        d["kl_coef"] = float(getattr(rt.extras["kl_ctrl"], "value", 0.0))
        d["sampler_state"] = rt.extras["sampler"].state_dict()
        d["keep_rate_state"] = rt.extras["keep_rate"].state_dict()
        return d


def total_training_steps(cfg, rt: runtime.Runtime) -> int:
    """trainer.total_training_steps, or epochs × (train prompts ÷ gen_batch_size) as in the reference."""
    if cfg.trainer.total_training_steps:
        return int(cfg.trainer.total_training_steps)
    per_epoch = max(len(rt.extras["sampler"].sampler) // gen_batch_size(cfg), 1)
    return per_epoch * int(cfg.trainer.total_epochs)


def _resume_path_dir(given: Path, ckpts, step: int) -> Path:
    """The checkpoint folder `trainer.resume_from_path` names: this run's `ckpt/step_<n>` (verified) or another
    run's, which must be a complete checkpoint (manifest and driver state present)."""
    if given.absolute().resolve() == ckpts.path(step).resolve():
        return ckpts.load(step)
    from dapo_core.store.checkpoint import MANIFEST_NAME

    for name in (MANIFEST_NAME, "driver_state.json", "actor"):
        if not (given / name).exists():
            raise ValueError(
                f"trainer.resume_from_path={str(given)!r} is not a complete checkpoint ({name} is "
                f"missing): point it at a ckpt/step_<n> folder written by dapo-train"
            )
    return given


def restore(rt: runtime.Runtime) -> DriverState:
    """Load the latest checkpoint (resume_mode auto / resume_path) and prepare later steps for replay."""
    cfg = rt.cfg
    state = DriverState(total_steps=total_training_steps(cfg, rt))
    ckpts = rt.extras["checkpoints"]
    mode = str(cfg.trainer.resume_mode)
    step = None
    if mode == "auto":
        step = ckpts.latest_step()
    elif mode == "resume_path":
        path = str(cfg.trainer.resume_from_path)
        if "step_" not in path:
            raise ValueError(f"trainer.resume_from_path={path!r} must point at a ckpt/step_<n> folder")
        step = int(path.rstrip("/").rsplit("step_", 1)[1])
    if step is not None:
        if mode == "resume_path":  # the folder named, which may belong to another run
            path = _resume_path_dir(Path(str(cfg.trainer.resume_from_path)), ckpts, step)
            moved = ckpts.rewind(step)  # later checkpoints of this run belong to the branch we leave
            if moved:
                print(f"resuming from step {step}: later checkpoints {moved} moved under ckpt/abandoned-*")
        else:
            path = ckpts.load(step)
        rt.worker("actor").call("load_checkpoint", str(Path(path) / "actor"))
        if rt.cluster.has("critic"):
            rt.worker("critic").call("load_checkpoint", str(Path(path) / "critic"))
        saved = json.loads((Path(path) / "driver_state.json").read_text())
        state.train_step, state.gen_step = int(saved["train_step"]), int(saved["gen_step"])
        state.weight_version = int(saved["weight_version"])
        rt.extras["sampler"].load_state_dict(saved["sampler_state"])
        if "keep_rate_state" in saved:
            rt.extras["keep_rate"].load_state_dict(saved["keep_rate_state"])
        if hasattr(rt.extras["kl_ctrl"], "value"):
            rt.extras["kl_ctrl"].value = float(saved["kl_coef"])
        rt.cluster.sync_weights("actor", "rollout")
        rt.worker("rollout").call("set_weight_version", state.weight_version)
    # Later steps: keep committed rollouts (replayed), drop everything computed from the lost weights.
    for s in rt.store.steps():
        if s > state.train_step:
            for stage in rt.store.committed_stages(s):
                if not stage.startswith(ROLLOUT_STAGES):
                    rt.store.delete_stage(s, stage)
    reissued = rt.store.reissue_inflight("train", state.train_step + 1)
    if reissued:
        print(f"re-issued {reissued} prompts that were in flight when the run stopped")
    return state


def step_metrics(run_id: str, step: int, adv_uri: str, metrics: dict) -> dict:
    """Data, timing and throughput metrics of a finished step (docs/REFERENCE.md §7.1–7.2 key names)."""
    rt = runtime.get(run_id)
    table = rt.store.read_uri(adv_uri)
    t = B.to_padded(
        table,
        rt.pad_token_id,
        columns=["advantages", "returns", "token_level_rewards"]
        + (["values"] if "values" in table.column_names else []),
    )
    from dapo_core.stages import place_scalar_at_last_token

    t["token_level_scores"] = place_scalar_at_last_token(
        table.column("reward").to_pylist(), B.response_lengths(table), t["responses"].shape[1]
    )
    out = dict(compute_data_metrics(t, use_critic="values" in table.column_names))
    timing = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("timing_s/")}
    timing.setdefault("gen", timing.get("generate", 0.0))  # the reference's timer names (§7.2) for our stages
    if "advantage" in timing:
        timing.setdefault("adv", timing["advantage"])
    out.update(compute_timing_metrics(t, timing))
    out.update(compute_throughput_metrics(t, timing, n_gpus=1))
    out["critic/acc/mean"] = float(
        sum(bool(a) for a in table.column("acc").to_pylist()) / max(table.num_rows, 1)
    )
    return out


def close_run(rt: runtime.Runtime) -> None:
    """Stop workers this run started, close the store and the logger, and make the end-of-run plot."""
    from dapo_core.metrics.tracking import plot_run

    try:
        rt.extras["tracker"].close()
        jsonl = rt.store.root / "metrics.jsonl"
        if jsonl.exists():
            try:
                plot_run(jsonl, rt.store.root / "curves.png")
            except Exception as exc:
                print(f"could not draw {rt.store.root / 'curves.png'}: {exc!r}")
    finally:
        rt.extras["progress"].close()
        rt.cluster.shutdown()
        runtime.unregister(rt.run_id)
        rt.store.close()
