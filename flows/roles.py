"""The run's workers: where they go (the colocated GPU pool of an fsdp2 run, else devices per role, refused up
front when the cluster is too small) and how each role is built from the typed config: the rollout replicas,
the actor, reward, reference and critic workers (`flows.run_setup.open_run` starts them in that order; with
LoRA the actor serves the reference and no reference worker starts).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from dapo_core.compute.cluster import Cluster
from dapo_core.compute.groups import create_role
from dapo_core.compute.lora import LoraSpec
from dapo_core.compute.placement import PlacementError
from dapo_core.compute.pools import DevicePool, pool_layout, same_nodes
from dapo_core.compute.replicas import RolloutReplicas, create_replicas, replica_layout
from dapo_core.compute.rpc import proxy
from dapo_core.compute.workers import ActorWorker, CriticWorker, RefWorker, RewardWorker, RolloutWorker
from dapo_core.config import (
    DapoConfig,
    RolloutConfig,
    ValKwargsConfig,
    need_ref_worker,
    runs_ahead,
    sync_parts,
    use_critic,
)


def _scheduler_steps(cfg: DapoConfig) -> int:
    """Optimizer-schedule length: one lr step per actor update (replay order: `parameter_sync_step`/step)."""
    per_step = sync_parts(cfg)
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


def dp_layout(cfg: DapoConfig) -> dict[str, int]:
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
    if need_ref_worker(cfg):
        need["ref"] = 1
    if use_critic(cfg):
        need["critic"] = 1
    return need


def check_gpu_count(cfg: DapoConfig, have: float) -> None:
    """Refuse, before any worker starts, a GPU run whose roles ask Ray for more GPUs than the cluster has
    (`gpu_demand`), and the replay-buffer order on a colocated pool (its generation runs beside training,
    which needs GPUs of its own); without it the last role waits for a placement that cannot come."""
    tr = cfg.trainer
    if colocated(cfg, "cuda") and runs_ahead(cfg):
        raise PlacementError(
            f"trainer.step_order={tr.step_order} generates while the actor trains, but with "
            "actor_rollout_ref.actor.strategy=fsdp2 on GPU every GPU holds an actor rank and a rollout shard "
            "that take turns (colocated), so the two cannot run at once",
            where="trainer.step_order",
            fix="use trainer.step_order=sync with fsdp2, or actor_rollout_ref.actor.strategy=torch or "
            "deepspeed (one GPU per role) for an order that generates ahead",
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
    roles = 1 + int(need_ref_worker(cfg)) + int(use_critic(cfg))
    tp = max(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, 1)
    layout = pool_layout(tr.nnodes, tr.n_gpus_per_node, roles, tp)
    res = tr.ray_resources
    where = same_nodes({"actor": res.actor, "ref": res.ref, "critic": res.critic, "rollout": res.rollout})
    return DevicePool.create(layout, resources=where, timeout_s=cluster.start_timeout_s)


def local_ray_cpus(cfg: DapoConfig, device: str = "cpu") -> int:
    """Logical CPUs of a local Ray: one per worker process (rollout replicas, reward, and each rank of the
    actor, reference and critic groups; a colocated pool reserves `shares` on every GPU bundle), at least
    `max(8, os.cpu_count())`."""
    tr, ro = cfg.trainer, cfg.actor_rollout_ref.rollout
    world = tr.nnodes * tr.n_gpus_per_node
    replicas = max(world // max(ro.tensor_model_parallel_size, 1), 1)
    layout = dp_layout(cfg)
    ranks = layout["nnodes"] * layout["per_node"]
    roles = 1 + int(need_ref_worker(cfg)) + int(use_critic(cfg))
    need = (roles + 1) * world + 1 if colocated(cfg, device) else replicas + 1 + roles * ranks
    return max(need, 8, os.cpu_count() or 2)


def rollout_replicas(cfg: DapoConfig, cluster: Cluster, model_path: str, device: str) -> RolloutReplicas:
    """The rollout replicas: `trainer.nnodes × trainer.n_gpus_per_node // tensor_model_parallel_size` engines
    (`dapo_core.compute.replicas`)."""
    ro = cfg.actor_rollout_ref.rollout
    layout = replica_layout(
        cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, ro.tensor_model_parallel_size, ro.name, device
    )
    # The replicas start with unset weights (nothing read from disk, so they start together cheaply) and the
    # run's first push (`flows.run_setup.open_run`) loads the actor's.
    engine_opts: dict[str, Any] = {"max_batch_size": ro.max_num_seqs, "dummy_weights": True}  # hf
    if ro.name == "vllm":
        engine_opts = {
            "gpu_memory_utilization": ro.gpu_memory_utilization,
            "tensor_parallel_size": ro.tensor_model_parallel_size,
            "enforce_eager": ro.enforce_eager,
            "max_num_seqs": ro.max_num_seqs,
            "load_format": "dummy",
            "max_num_batched_tokens": ro.max_num_batched_tokens,
            "max_model_len": ro.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
            **({"enable_chunked_prefill": ro.enable_chunked_prefill} if device == "cuda" else {}),
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


def actor_worker(cfg: DapoConfig, cluster: Cluster, model_path: str, pad: int, device: str) -> ActorWorker:
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
        lora=LoraSpec.from_model_config(arr.model),
    )
    where = cfg.trainer.ray_resources.actor
    group = create_role(
        cluster,
        "actor",
        factory,
        num_gpus=_gpus(device),
        resources=where,
        pool=cluster.pool,
        **dp_layout(cfg),
    )
    return proxy(group, ActorWorker)


def reward_worker(cfg: DapoConfig, cluster: Cluster, tokenizer_path: str) -> RewardWorker:
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


def ref_worker(cfg: DapoConfig, cluster: Cluster, model_path: str, pad: int, device: str) -> RefWorker:
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
        cluster, "ref", factory, num_gpus=_gpus(device), resources=where, pool=cluster.pool, **dp_layout(cfg)
    )
    return proxy(group, RefWorker)


def critic_worker(cfg: DapoConfig, cluster: Cluster, model_path: str, pad: int, device: str) -> CriticWorker:
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
    layout = dp_layout(cfg)
    group = create_role(
        cluster, "critic", factory, num_gpus=_gpus(device), resources=where, pool=cluster.pool, **layout
    )
    return proxy(group, CriticWorker)
