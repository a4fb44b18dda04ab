"""Setup and cleanup of a training run: config, run store, data samplers, workers, resume state, step metrics.

Plumbing kept out of `flows/dapo_train.py` so that file reads like the algorithm.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from omegaconf import OmegaConf

from dapo_core.algo.dynamic_sampling import KeepRateEstimator, surplus_bounded_size
from dapo_core.algo.kl import get_kl_controller
from dapo_core.compute.cluster import Cluster, PlacementError, proxy, worker_threads
from dapo_core.compute.groups import create_role
from dapo_core.compute.models import load_tokenizer
from dapo_core.compute.pools import DevicePool, pool_layout, same_nodes
from dapo_core.compute.replicas import RolloutReplicas, create_replicas, replica_layout
from dapo_core.compute.workers import ActorWorker, CriticWorker, RefWorker, RewardWorker, RolloutWorker
from dapo_core.config import (
    DapoConfig,
    DataConfig,
    RolloutConfig,
    ValKwargsConfig,
    gen_batch_size,
    need_reference_policy,
    resolve_device,
    to_safe_yaml,
    use_critic,
)
from dapo_core.data.datasets import PromptSampler, read_parquet
from dapo_core.data.sampler import MIXED, HistorySampler, group_outcomes
from dapo_core.metrics.step import compute_throughput_metrics, compute_timing_metrics
from dapo_core.metrics.tracking import Tracker
from dapo_core.stages import batch_data_metrics
from dapo_core.store import RunStore, StoreCorruption
from dapo_core.store.checkpoint import MANIFEST_NAME, CheckpointDir, CheckpointError, verify_folder
from dapo_core.store.files import atomic_write_bytes
from dapo_core.store.fingerprints import (
    InputsChanged,
    changes,
    config_fingerprint,
    data_fingerprint,
    folder_fingerprint,
)
from dapo_core.store.lease import Lease
from dapo_core.store.lease import acquire as acquire_lease
from flows.progress import StepProgress
from tasks import runtime
from tasks.runtime import ChunkSampler
from tasks.update import push_weights

# Stages of a step that depend only on the weights the step started from: kept on resume and replayed.
ROLLOUT_STAGES = ("prompts_g", "generate_g", "reward_g", "kept_g", "batch", "replay_add_")


def default_model_path(cfg: DapoConfig) -> str:
    """`actor_rollout_ref.model.path`, or the embedded tiny base model built by the base-model flow."""
    return cfg.actor_rollout_ref.model.path or str(Path(cfg.trainer.models_dir) / "tiny_base")


def read_table(files: list[str]) -> pa.Table:
    """Concatenate one or several verl parquet files (paths or URLs)."""
    tables = [read_parquet(f) for f in files]
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]


def val_prompts(data: DataConfig, tokenizer: Any, files: list[str] | None = None) -> pa.Table:
    """All validation prompts of `files` (default `data.val_files`), tokenised, in file order."""
    table = read_table(files or data.val_files)
    sampler = PromptSampler(
        table,
        tokenizer,
        batch_size=table.num_rows,
        shuffle=False,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
    )
    return sampler.next_batch()


def _scheduler_steps(cfg: DapoConfig) -> int:
    """Optimizer-schedule length: one lr step per actor update (replay order: `parameter_sync_step`/step)."""
    per_step = cfg.trainer.parameter_sync_step if cfg.trainer.step_order == "replay_buffer" else 1
    return max(cfg.trainer.total_training_steps or 1, 1) * per_step


def _gpus(device: str) -> float:
    """GPUs a model-holding worker asks for."""
    return 1.0 if device == "cuda" else 0.0


def _sampling(ro: RolloutConfig | ValKwargsConfig, max_new_tokens: int) -> dict:
    """Generation settings of the rollout (or its `val_kwargs`) for the rollout worker."""
    return {
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "top_k": ro.top_k,
        "max_new_tokens": max_new_tokens,
        "do_sample": ro.do_sample,
    }


def _dp_layout(cfg: DapoConfig) -> dict[str, int]:
    """The data-parallel ranks of the actor, reference and critic: with `actor.strategy: fsdp2`,
    `trainer.nnodes` nodes × `trainer.n_gpus_per_node` ranks (GPUs, or on CPU processes of one core each);
    one otherwise."""
    if cfg.actor_rollout_ref.actor.strategy != "fsdp2":
        return {"nnodes": 1, "per_node": 1}
    return {"nnodes": cfg.trainer.nnodes, "per_node": cfg.trainer.n_gpus_per_node}


def colocated(cfg: DapoConfig, device: str) -> bool:
    """Whether the run shares every GPU among the roles (`dapo_core.compute.pools`): fsdp2 on GPU under Ray,
    the layout `dapo plan` models for it."""
    return device == "cuda" and cfg.trainer.use_ray and cfg.actor_rollout_ref.actor.strategy == "fsdp2"


def gpu_demand(cfg: DapoConfig) -> dict[str, int]:
    """GPUs the run asks Ray for on GPU. Colocated (fsdp2): the pool of `trainer.nnodes × n_gpus_per_node`
    GPUs that every role shares. Otherwise every role holds devices of its own: the rollout replicas take
    `trainer.nnodes × n_gpus_per_node` (M replicas × TP), the actor, reference and critic one each."""
    tr, ro = cfg.trainer, cfg.actor_rollout_ref.rollout
    tp = max(ro.tensor_model_parallel_size, 1)
    if colocated(cfg, "cuda"):
        return {"pool": tr.nnodes * tr.n_gpus_per_node}
    need = {"rollout": max(tr.nnodes * tr.n_gpus_per_node // tp, 1) * tp, "actor": 1}
    if need_reference_policy(cfg):
        need["ref"] = 1
    if use_critic(cfg):
        need["critic"] = 1
    return need


def check_gpu_count(cfg: DapoConfig, have: float) -> None:
    """Refuse, before any worker starts, a GPU run whose roles ask Ray for more GPUs than the cluster has
    (`gpu_demand`), and the replay-buffer order on a colocated pool (its generation runs beside training,
    which needs GPUs of its own); without it the last role waits for a placement that cannot come."""
    tr = cfg.trainer
    if colocated(cfg, "cuda") and tr.step_order == "replay_buffer":
        raise PlacementError(
            "trainer.step_order=replay_buffer generates while the actor trains, but with "
            "actor_rollout_ref.actor.strategy=fsdp2 on GPU every GPU holds an actor rank and a rollout shard "
            "that take turns (colocated), so the two cannot run at once",
            where="trainer.step_order",
            fix="use trainer.step_order=sync with fsdp2, or actor_rollout_ref.actor.strategy=torch or "
            "deepspeed (one GPU per role) for the replay-buffer order",
        )
    need = gpu_demand(cfg)
    total = sum(need.values())
    if total <= have:
        return
    tp = max(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, 1)
    if "pool" in need:
        world = int(have) // tp * tp
        what = (
            f"its colocated pool asks Ray for trainer.nnodes × trainer.n_gpus_per_node = {total} GPUs (every "
            f"GPU holds a rank of each training role and a rollout shard) and the cluster has {have:g}"
        )
    else:
        parts = ", ".join(f"{role} {n}" for role, n in need.items())
        world = max((int(have) - (len(need) - 1)) // tp * tp, 0)
        what = (
            f"this run asks Ray for {total} GPUs ({parts}) and the cluster has {have:g}: with "
            f"actor_rollout_ref.actor.strategy={cfg.actor_rollout_ref.actor.strategy} every role runs on "
            f"GPUs of its own (fsdp2 shares them)"
        )
    raise PlacementError(
        what,
        where="trainer.nnodes / trainer.n_gpus_per_node",
        fix=(
            f"make trainer.nnodes × trainer.n_gpus_per_node at most {world} (a multiple of "
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}), or add GPUs to the cluster"
            if world
            else "add GPUs to the cluster: it cannot hold one rollout replica and the training roles"
        ),
    )


def device_pool(cfg: DapoConfig, cluster: Cluster) -> DevicePool:
    """Reserve the colocated pool (`colocated`) the roles share: one GPU bundle per GPU, shared by a rank of
    each training role and the rollout shard."""
    tr = cfg.trainer
    roles = 1 + int(need_reference_policy(cfg)) + int(use_critic(cfg))
    tp = max(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, 1)
    layout = pool_layout(tr.nnodes, tr.n_gpus_per_node, roles, tp)
    res = tr.ray_resources
    where = same_nodes({"actor": res.actor, "ref": res.ref, "critic": res.critic, "rollout": res.rollout})
    return DevicePool.create(layout, resources=where, timeout_s=cluster.start_timeout_s)


def _local_ray_cpus(cfg: DapoConfig) -> int:
    """Logical CPUs of a local Ray: one per worker process (rollout replicas, reward, and each rank of the
    actor, reference and critic groups), at least `max(8, os.cpu_count())`."""
    tr, ro = cfg.trainer, cfg.actor_rollout_ref.rollout
    replicas = max(tr.nnodes * tr.n_gpus_per_node // max(ro.tensor_model_parallel_size, 1), 1)
    layout = _dp_layout(cfg)
    ranks = layout["nnodes"] * layout["per_node"]
    roles = 1 + int(need_reference_policy(cfg)) + int(use_critic(cfg))
    return max(replicas + 1 + roles * ranks, 8, os.cpu_count() or 2)


def _rollout_worker(cfg: DapoConfig, cluster: Cluster, model_path: str, device: str) -> RolloutReplicas:
    """The rollout replicas: `trainer.nnodes × trainer.n_gpus_per_node // tensor_model_parallel_size` engines
    (`dapo_core.compute.replicas`)."""
    ro = cfg.actor_rollout_ref.rollout
    layout = replica_layout(
        cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, ro.tensor_model_parallel_size, ro.name, device
    )
    engine_opts: dict[str, Any] = {"max_batch_size": ro.max_num_seqs}  # hf: rows per forward
    if ro.name == "vllm":
        engine_opts = {
            "gpu_memory_utilization": ro.gpu_memory_utilization,
            "tensor_parallel_size": ro.tensor_model_parallel_size,
            "enforce_eager": ro.enforce_eager,
            "max_num_seqs": ro.max_num_seqs,
            # colocated: the engine sleeps while the training ranks on its GPUs run
            "enable_sleep_mode": cluster.pool is not None and ro.free_cache_engine,
            **layout.engine_opts,
        }
    if ro.dtype != "auto":
        engine_opts["dtype"] = ro.dtype

    def factory(num_threads: int | None, visible_devices: str | None) -> Callable[[], RolloutWorker]:
        return functools.partial(
            RolloutWorker,
            model_path,
            engine=ro.name,
            device=device,
            seed=cfg.trainer.seed,
            train_sampling=_sampling(ro, cfg.data.max_response_length),
            val_sampling=_sampling(ro.val_kwargs, cfg.data.max_response_length),
            engine_opts=engine_opts,
            num_threads=num_threads,
            visible_devices=visible_devices,
        )

    return create_replicas(
        cluster,
        factory,
        layout,
        max_new_tokens=cfg.data.max_response_length,
        resources=cfg.trainer.ray_resources.rollout,
        pool=cluster.pool,
    )


def _actor_worker(cfg: DapoConfig, cluster: Cluster, model_path: str, pad: int, device: str) -> ActorWorker:
    arr = cfg.actor_rollout_ref
    rc = cfg.algorithm.rollout_correction
    actor_cfg = arr.actor
    if rc.bypass_mode:
        bypass = dataclasses.replace(actor_cfg.policy_loss, loss_mode="bypass_mode")
        actor_cfg = dataclasses.replace(actor_cfg, policy_loss=bypass)
    factory = functools.partial(
        ActorWorker,
        model_path,
        actor_cfg,
        pad_token_id=pad,
        temperature=arr.rollout.temperature,
        rollout_n=arr.rollout.n,
        total_steps=_scheduler_steps(cfg),
        device=device,
        seed=cfg.trainer.seed,
        log_prob_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
        rollout_correction=rc,
        log_prob_max_token_len=(
            arr.rollout.log_prob_max_token_len_per_gpu if arr.rollout.log_prob_use_dynamic_bsz else None
        ),
        gradient_checkpointing=arr.model.enable_gradient_checkpointing,
        use_remove_padding=arr.model.use_remove_padding,
        use_shared_prompt=arr.model.use_shared_prompt,
    )
    where = cfg.trainer.ray_resources.actor
    group = create_role(
        cluster,
        "actor",
        factory,
        num_gpus=_gpus(device),
        resources=where,
        pool=cluster.pool,
        **_dp_layout(cfg),
    )
    return proxy(group, ActorWorker)


def _reward_worker(cfg: DapoConfig, cluster: Cluster, tokenizer_path: str) -> RewardWorker:
    rm = cfg.reward_model
    factory = functools.partial(
        RewardWorker,
        tokenizer_path,
        max_resp_len=cfg.data.max_response_length,
        overlong_buffer=asdict(rm.overlong_buffer),
        num_workers=rm.num_workers,
        timeout_s=rm.timeout_s,
        max_failure_rate=rm.max_failure_rate,
    )
    return proxy(cluster.create("reward", factory, resources=cfg.trainer.ray_resources.reward), RewardWorker)


def _ref_worker(cfg: DapoConfig, cluster: Cluster, model_path: str, pad: int, device: str) -> RefWorker:
    arr = cfg.actor_rollout_ref
    factory = functools.partial(
        RefWorker,
        model_path,
        pad_token_id=pad,
        temperature=arr.rollout.temperature,
        device=device,
        micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
        max_token_len=arr.ref.log_prob_max_token_len_per_gpu if arr.ref.log_prob_use_dynamic_bsz else None,
        use_remove_padding=arr.model.use_remove_padding,
        use_shared_prompt=arr.model.use_shared_prompt,
        dtype=arr.ref.dtype,
    )
    where = cfg.trainer.ray_resources.ref
    group = create_role(
        cluster, "ref", factory, num_gpus=_gpus(device), resources=where, pool=cluster.pool, **_dp_layout(cfg)
    )
    return proxy(group, RefWorker)


def _critic_worker(cfg: DapoConfig, cluster: Cluster, model_path: str, pad: int, device: str) -> CriticWorker:
    critic_cfg, actor_cfg = cfg.critic, cfg.actor_rollout_ref.actor
    follow = ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "use_dynamic_bsz")
    # verl: unset critic batch settings follow the actor's
    critic_cfg = dataclasses.replace(
        critic_cfg, **{k: getattr(actor_cfg, k) for k in follow if getattr(critic_cfg, k) is None}
    )
    factory = functools.partial(
        CriticWorker,
        model_path,
        critic_cfg,
        pad_token_id=pad,
        rollout_n=cfg.actor_rollout_ref.rollout.n,
        device=device,
        seed=cfg.trainer.seed,
        gradient_checkpointing=cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
        total_steps=_scheduler_steps(cfg),
        shuffle=actor_cfg.shuffle,
    )
    where = cfg.trainer.ray_resources.critic
    layout = _dp_layout(cfg)
    group = create_role(
        cluster, "critic", factory, num_gpus=_gpus(device), resources=where, pool=cluster.pool, **layout
    )
    return proxy(group, CriticWorker)


@dataclass(kw_only=True)
class TrainRun(runtime.Runtime):
    """The flow's view of a run: the tasks' `Runtime` plus what only the driver uses."""

    tracker: Tracker
    """Metric sinks (console, jsonl, tensorboard)."""
    progress: StepProgress
    """The live console display."""
    keep_rate: KeepRateEstimator = field(default_factory=KeepRateEstimator)
    """Observed share of kept groups, which sizes adaptive refills (checkpointed)."""
    inputs: dict = field(default_factory=dict)
    """Fingerprints of this attempt's data, base model and training config (recorded as inputs.json)."""
    changed_inputs: list[str] = field(default_factory=list)
    """What differs from the run's recorded inputs (non-empty only with trainer.allow_changed_inputs)."""


INPUTS_FILE = "inputs.json"
"""The run's record of its inputs' fingerprints (`dapo_core.store.fingerprints`)."""


def input_fingerprints(
    cfg: DapoConfig, model_path: str, tokenizer_path: str, train: pa.Table, val: pa.Table, known: dict | None
) -> dict:
    """The fingerprints of this attempt's inputs: data files and rows, base model and tokenizer folders,
    training-relevant config keys (files whose size and mtime match `known` are not re-hashed)."""
    known = known or {}
    out = {
        "format": 1,
        "data": {
            "train": data_fingerprint(cfg.data.train_files, train, known.get("data", {}).get("train")),
            "val": data_fingerprint(cfg.data.val_files, val, known.get("data", {}).get("val")),
        },
        "model": folder_fingerprint(model_path, known.get("model")),
        "config": config_fingerprint(OmegaConf.to_container(OmegaConf.structured(cfg))),  # type: ignore[arg-type]
    }
    if Path(tokenizer_path).resolve() != Path(model_path).resolve():
        out["tokenizer"] = folder_fingerprint(tokenizer_path, known.get("tokenizer"))
    return out


def check_inputs(store: RunStore, cfg: DapoConfig, inputs: dict) -> list[str]:
    """Compare this attempt's inputs with the run's record: [] when equal or when the run is new; the
    changes when `trainer.allow_changed_inputs` (after a warning); else :class:`InputsChanged` naming them."""
    old = store.read_json(INPUTS_FILE, default=None)
    if old is None:
        if store.steps() or store.checkpoints.steps():
            print(
                f"warning: {store.root} has no {INPUTS_FILE} (a run started by an older version): this "
                f"attempt's inputs are recorded now; changes made before it cannot be detected"
            )
        return []
    diff = changes(old, inputs)
    if not diff:
        return []
    listed = "; ".join(diff)
    if not cfg.trainer.allow_changed_inputs:
        raise InputsChanged(
            f"run {store.root.name} was started with other inputs than this attempt uses: {listed}",
            where=str(store.root / INPUTS_FILE),
            fix=(
                "resume with the run's original data, base model and config; or start a new run (a new "
                "trainer.experiment_name); or, to continue this run with the new inputs on purpose, set "
                "trainer.allow_changed_inputs=true (stored rollouts of later steps are then discarded)"
            ),
        )
    print(
        f"warning: continuing run {store.root.name} with changed inputs (trainer.allow_changed_inputs=true): "
        f"{listed}. Rollouts stored for steps after the checkpoint are discarded and regenerated"
    )
    return diff


def config_record(cfg: DapoConfig) -> str:
    """The config as written to the run folder: resolved, secrets written back as `${oc.env:NAME}`
    (`to_safe_yaml`)."""
    return to_safe_yaml(OmegaConf.structured(cfg))


def record_attempt(rt: TrainRun) -> Path:
    """Write this attempt's records once its setup and restore succeeded: `config.<n>.yaml` (n = attempt
    number; earlier attempts' files are never overwritten), `config.yaml` (the config in force) and
    `inputs.json` (a replaced record is kept as `inputs.<n>.replaced.json`). Returns config.<n>.yaml."""
    root = rt.store.root
    attempts = [
        int(m.group(1)) for p in root.iterdir() if (m := re.fullmatch(r"config\.(\d+)\.yaml", p.name))
    ]
    if not attempts and (root / "config.yaml").exists():  # a run of an older version: keep its record
        atomic_write_bytes(root / "config.0.yaml", (root / "config.yaml").read_bytes())
    n = max(attempts, default=0) + 1
    text = config_record(rt.cfg).encode()
    path = root / f"config.{n}.yaml"
    atomic_write_bytes(path, text)
    atomic_write_bytes(root / "config.yaml", text)
    if rt.changed_inputs and (root / INPUTS_FILE).exists():
        atomic_write_bytes(root / f"inputs.{n}.replaced.json", (root / INPUTS_FILE).read_bytes())
    rt.store.write_json(INPUTS_FILE, rt.inputs)
    # this attempt's workers: every rank of every role with its Ray node ("in-process" without Ray); the
    # rollout replicas report themselves as role `rollout`, rank = replica
    replicas = {w["name"] for w in rt.rollout.workers_info()}
    trainers = [w for w in rt.cluster.workers if w["role"] not in replicas]
    rt.store.write_json("workers.json", {"workers": trainers + rt.rollout.workers_info()})
    return path


def train_sampler(cfg: DapoConfig, table: pa.Table, tokenizer: Any) -> PromptSampler:
    """The training prompts' sampler, one prompt per draw: verl's seeded epochs (`PromptSampler`), or with
    `data.history_sampler.enable` the `HistorySampler` that passes over prompts whose recent groups had no
    reward spread. The latter is for the sync step order: in the replay order rewards arrive after later
    draws, in an order a resumed run could not replay exactly, so there the switch is ignored (one line says
    so) and verl's sampler draws."""
    opts: dict[str, Any] = {
        "batch_size": 1,
        "seed": cfg.data.seed,
        "shuffle": cfg.data.shuffle,
        "max_prompt_length": cfg.data.max_prompt_length,
        "truncation": cfg.data.truncation,
    }
    hs = cfg.data.history_sampler
    if not hs.enable:
        return PromptSampler(table, tokenizer, **opts)
    if cfg.trainer.step_order != "sync":
        print(
            f"data.history_sampler: not used with trainer.step_order={cfg.trainer.step_order} (sync order "
            "only); verl's sampler draws the prompts"
        )
        return PromptSampler(table, tokenizer, **opts)
    return HistorySampler(table, tokenizer, window=hs.window, explore_prob=hs.explore_prob, **opts)


def observe_rewards(rt: runtime.Runtime, reward_uri: str) -> dict[str, float]:
    """Feed a scored generation batch's per-group outcomes to a `HistorySampler` (nothing otherwise); returns
    its metrics: the share of the batch's groups without reward spread and of draws passed over so far."""
    inner = rt.sampler.sampler
    if not isinstance(inner, HistorySampler):
        return {}
    table = rt.store.read_uri(reward_uri, verify=False, columns=["prompt_id", "acc"])
    pids, accs = table.column("prompt_id").to_pylist(), table.column("acc").to_pylist()
    outcomes = [c for codes in group_outcomes(pids, accs).values() for c in codes]
    inner.observe(pids, accs)
    draws = max(inner.passed_over + inner.drawn, 1)
    return {
        "train/history_sampler/zero_spread_share": sum(c != MIXED for c in outcomes) / max(len(outcomes), 1),
        "train/history_sampler/passed_over_share": inner.passed_over / draws,
    }


def open_run(cfg: DapoConfig, run_id: str) -> TrainRun:
    """Open (or create) `runs/<run_id>/`, check the inputs against the run's record, start the workers, build
    the samplers, register the runtime. Nothing is written to the run's records here (`record_attempt`
    does, once `restore` succeeded)."""
    root = Path(cfg.trainer.runs_dir) / run_id
    lease = take_lease(cfg, root)  # one writer per run: refused here while another process holds it
    store = RunStore(root)
    if cfg.trainer.resume_mode == "disable" and (
        store.checkpoints.latest_step() is not None or store.steps()
    ):
        store.close()
        lease.release()
        raise RuntimeError(
            f"run {run_id} already has outputs in {root} and trainer.resume_mode=disable: "
            f"choose a new trainer.experiment_name, delete the folder, or set trainer.resume_mode=auto"
        )
    model_path = default_model_path(cfg)
    tokenizer_path = cfg.actor_rollout_ref.model.tokenizer_path or model_path
    device = resolve_device(cfg)
    cluster = tracker = None
    try:
        tokenizer = load_tokenizer(tokenizer_path)
        pad = int(tokenizer.pad_token_id)
        # Data first (cheap, and a wrong path should fail before workers spend minutes loading models).
        train_table = read_table(cfg.data.train_files)
        sampler = ChunkSampler(train_sampler(cfg, train_table, tokenizer))
        val_table = val_prompts(cfg.data, tokenizer)
        inputs = input_fingerprints(
            cfg,
            model_path,
            tokenizer_path,
            train_table,
            val_table,
            store.read_json(INPUTS_FILE, default=None),
        )
        changed = check_inputs(store, cfg, inputs)
        kl = cfg.algorithm.kl_ctrl
        kl_ctrl = get_kl_controller(kl.type, kl.kl_coef, kl.horizon, kl.target_kl)
        tracker = Tracker(root, cfg.trainer.logger)
        cluster = Cluster(
            run_id,
            use_ray=cfg.trainer.use_ray,
            address=cfg.trainer.ray_address,
            device=device,
            num_cpus=_local_ray_cpus(cfg),
            # sync order: one stage at a time; replay order: generation overlaps the update
            num_threads=worker_threads(
                cfg.trainer.num_threads, 2 if cfg.trainer.step_order == "replay_buffer" else 1, device
            ),
        )
        if device == "cuda" and cfg.trainer.use_ray:
            import ray

            check_gpu_count(cfg, float(ray.cluster_resources().get("GPU", 0.0)))
            if colocated(cfg, device):
                cluster.pool = device_pool(cfg, cluster)
        rt = TrainRun(
            run_id=run_id,
            cfg=cfg,
            store=store,
            cluster=cluster,
            pad_token_id=pad,
            vocab_size=len(tokenizer),
            # created in this order: rollout, actor, reward, [ref], [critic]
            rollout=_rollout_worker(cfg, cluster, model_path, device),
            actor=_actor_worker(cfg, cluster, model_path, pad, device),
            reward=_reward_worker(cfg, cluster, tokenizer_path),
            ref=_ref_worker(cfg, cluster, model_path, pad, device) if need_reference_policy(cfg) else None,
            critic=_critic_worker(cfg, cluster, model_path, pad, device) if use_critic(cfg) else None,
            sampler=sampler,
            val_prompts=val_table,
            kl_ctrl=kl_ctrl,
            tracker=tracker,
            progress=StepProgress(run_id, enabled=sys.stdout.isatty() or "console" in cfg.trainer.logger),
            inputs=inputs,
            changed_inputs=changed,
        )
    except (
        BaseException
    ):  # nothing of a half-opened run may outlive it (Ray actors, a Ray we started, the store)
        if cluster is not None:
            cluster.shutdown()
        if tracker is not None:
            tracker.close()
        store.close()
        lease.release()
        raise
    runtime.register(rt)
    _LEASES[run_id] = lease
    lease.start_heartbeat()
    return rt


_LEASES: dict[str, Lease] = {}
"""The lease each open run of this process holds (released by `close_run`)."""


def take_lease(cfg: DapoConfig, root: Path) -> Lease:
    """Take the run's lease (`dapo_core.store.lease`), naming this Prefect flow run as the holder; a lease
    taken over from a stale holder is logged. Losing it later interrupts the main thread (stop writing)."""
    import _thread

    from prefect.runtime import flow_run

    lease = acquire_lease(
        root,
        timeout_s=cfg.trainer.lease_timeout_s,
        wait_s=cfg.trainer.lease_wait_s,
        flow_run_id=str(flow_run.id or ""),
        on_lost=_thread.interrupt_main,
    )
    if lease.took_over:
        print(f"run {root.name}: {lease.took_over}", file=sys.stderr, flush=True)
    return lease


@dataclass
class DriverState:
    """What the driver must remember across a restart (stored in each checkpoint as driver_state.json)."""

    train_step: int = 0
    gen_step: int = 0
    weight_version: int = 0
    total_steps: int = 0
    kl_coef: float = 0.0

    def to_json(self, run: TrainRun) -> dict:
        """The state to checkpoint, with the run's KL coefficient, sampler position and keep-rate counts."""
        d = asdict(self)
        d["kl_coef"] = float(run.kl_ctrl.value)
        d["sampler_state"] = run.sampler.state_dict()
        d["keep_rate_state"] = run.keep_rate.state_dict()
        return d


def total_training_steps(run: TrainRun) -> int:
    """trainer.total_training_steps, or epochs × (train prompts ÷ gen_batch_size) as in the reference."""
    cfg = run.cfg
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    per_epoch = max(len(run.sampler.sampler) // gen_batch_size(cfg), 1)
    return per_epoch * cfg.trainer.total_epochs


def _resume_path_dir(given: Path, ckpts: CheckpointDir, step: int) -> Path:
    """The checkpoint folder `trainer.resume_from_path` names: this run's `ckpt/step_<n>` or another run's,
    which must be a complete checkpoint (manifest and driver state present); verified against its manifest
    either way."""
    if given.absolute().resolve() == ckpts.path(step).resolve():
        return ckpts.load(step)
    for name in (MANIFEST_NAME, "driver_state.json", "actor"):
        if not (given / name).exists():
            raise CheckpointError(
                f"trainer.resume_from_path={str(given)!r} is not a complete checkpoint ({name} is missing)",
                fix="point it at a ckpt/step_<n> folder written by dapo-train",
            )
    verify_folder(given)
    return given


def restore(rt: TrainRun) -> DriverState:
    """Load the latest checkpoint (resume_mode auto / resume_path) and prepare later steps for replay."""
    cfg = rt.cfg
    state = DriverState(total_steps=total_training_steps(rt))
    ckpts = rt.store.checkpoints
    mode, given = cfg.trainer.resume_mode, cfg.trainer.resume_from_path or ""
    step = None
    if mode == "auto":
        step = ckpts.resume_step(warn=print)  # a lost `latest` pointer: the newest verifying checkpoint
    elif mode == "resume_path":
        if "step_" not in given:
            raise ValueError(f"trainer.resume_from_path={given!r} must point at a ckpt/step_<n> folder")
        step = int(given.rstrip("/").rsplit("step_", 1)[1])
    if step is not None:
        if mode == "resume_path":  # the folder named, which may belong to another run
            path = _resume_path_dir(Path(given), ckpts, step)
            moved = ckpts.rewind(step)  # later checkpoints of this run belong to the branch we leave
            if moved:
                print(f"resuming from step {step}: later checkpoints {moved} moved under ckpt/abandoned-*")
        else:
            path = ckpts.load(step)
        rt.actor.load_checkpoint(str(path / "actor"))
        if rt.critic is not None:
            rt.critic.load_checkpoint(str(path / "critic"))
        saved = json.loads((path / "driver_state.json").read_text())
        state.train_step, state.gen_step = int(saved["train_step"]), int(saved["gen_step"])
        state.weight_version = int(saved["weight_version"])
        rt.sampler.load_state_dict(saved["sampler_state"])
        if "keep_rate_state" in saved:
            rt.keep_rate.load_state_dict(saved["keep_rate_state"])
        rt.kl_ctrl.value = float(saved["kl_coef"])
        push_weights(rt, state.weight_version)
    dropped = rt.tracker.rewind(state.train_step)
    if dropped:
        print(
            f"metrics: dropped {dropped} rows of steps after {state.train_step} (this attempt logs them anew)"
        )
    # Later steps: keep committed rollouts (replayed), drop everything computed from the lost weights — and
    # the rollouts too when the inputs changed (they came from the old data or model).
    for s in rt.store.steps():
        if s > state.train_step:
            for stage in rt.store.committed_stages(s):
                if rt.changed_inputs or not stage.startswith(ROLLOUT_STAGES):
                    rt.store.delete_stage(s, stage)
                else:
                    _verify_replayed(rt.store, s, stage)
    if rt.changed_inputs:
        n = rt.store.drop_prompts_after("train", state.train_step)
        if n:
            print(f"dropped {n} prompts drawn from the old inputs after step {state.train_step}")
    reissued = rt.store.reissue_inflight("train", state.train_step + 1)
    if reissued:
        print(f"re-issued {reissued} prompts that were in flight when the run stopped")
    record_attempt(rt)
    return state


def _verify_replayed(store: RunStore, step: int, stage: str) -> None:
    """Checksum a stage that a resumed run will replay; a corrupted one (possibly shadowed by a later stage,
    so never read again) is reported and un-committed, so it is recomputed if anything needs it."""
    if not store.is_committed(step, stage):
        return  # deleted with a corrupted stage it was built on (a column delta): recomputed if needed
    try:
        store.verify_stage(step, stage)
    except StoreCorruption as e:
        print(f"warning: {e} — un-committing stage {stage!r} of step {step}; it is recomputed if needed")
        store.delete_stage(step, stage)


def add_metrics(metrics: dict[str, float], new: dict[str, float]) -> None:
    """Fold a generation batch's metrics into the step's: times, token counts and added groups add up, any
    other key keeps its latest value."""
    for key, v in new.items():
        summed = key.startswith(("timing_s/", "perf/")) or key == "train/added_groups"
        metrics[key] = metrics.get(key, 0.0) + v if summed else v


def refill_size(cfg: DapoConfig, keep_rate: KeepRateEstimator, deficit: int, fixed: int) -> int:
    """Prompts to generate for `deficit` missing groups: `fixed`, or with `algorithm.filter_groups.refill=
    adaptive` the largest batch whose expected surplus under the observed keep rate stays within
    `filter_groups.surplus_budget · train_batch_size` groups (`surplus_bounded_size`; `gen_batch_size` before
    any rate is observed); 0 when nothing is missing."""
    if deficit <= 0:
        return 0
    fg = cfg.algorithm.filter_groups
    if fg.enable and fg.refill == "adaptive":
        budget = fg.surplus_budget * cfg.data.train_batch_size
        return surplus_bounded_size(deficit, keep_rate.rate, surplus_budget=budget, base=gen_batch_size(cfg))
    return fixed


def step_metrics(rt: runtime.Runtime, step: int, adv_uri: str, metrics: dict) -> dict:
    """Data, timing and throughput metrics of a finished step (docs/REFERENCE.md §7.1–7.2 key names). The
    data metrics are computed on the reward worker, which reads the advantage view from the store; the
    driver gets a few numbers and the per-row lengths, never the table."""
    import torch

    out, lengths = rt.reward.summarize(
        str(rt.store.root), adv_uri, functools.partial(batch_data_metrics, pad_token_id=rt.pad_token_id)
    )
    timing = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("timing_s/")}
    timing.setdefault("gen", timing.get("generate", 0.0))  # the reference's timer names (§7.2) for our stages
    if "advantage" in timing:
        timing.setdefault("adv", timing["advantage"])
    counts = {k: torch.tensor(v, dtype=torch.long) for k, v in lengths.items()}
    counts |= {"prompts": torch.empty(0, 0), "responses": torch.empty(0, 0)}  # widths: unused by §7.2
    out.update(compute_timing_metrics(counts, timing))
    out.update(compute_throughput_metrics(counts, timing, n_gpus=1))
    return out


def close_run(rt: TrainRun) -> None:
    """Stop workers this run started, close the store and the logger, and make the end-of-run plot."""
    from dapo_core.metrics.tracking import plot_run

    try:
        rt.tracker.close()
        jsonl = rt.store.root / "metrics.jsonl"
        if jsonl.exists():
            try:
                plot_run(jsonl, rt.store.root / "curves.png")
            except Exception as exc:
                print(f"could not draw {rt.store.root / 'curves.png'}: {exc!r}")
    finally:
        rt.progress.close()
        rt.cluster.shutdown()
        runtime.unregister(rt.run_id)
        rt.store.close()
        lease = _LEASES.pop(rt.run_id, None)
        if lease is not None:
            lease.release()
