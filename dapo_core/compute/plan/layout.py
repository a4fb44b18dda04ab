"""Where the roles run: the `Layout` of a config (nodes, GPUs per node, the actor's sharding, the rollout's
tensor parallel, colocated or not), `resolve_layout` and `_opt`, the reading of an optional config key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapo_core.compute.plan_advice import FSDP_STRATEGIES


def _opt(obj: Any, dotted: str, default: Any) -> Any:
    """`obj.a.b`, or `default` where the config has no such key or it is null."""
    for part in dotted.split("."):
        if obj is None or not hasattr(obj, part):
            return default
        obj = getattr(obj, part)
    return default if obj is None else obj


@dataclass(frozen=True)
class Layout:
    """Where the roles run: the cluster, the actor's sharding and the rollout's tensor parallel."""

    device: str
    nnodes: int
    per_node: int
    """GPUs per node (`trainer.n_gpus_per_node`); processes per node on CPU."""
    strategy: str
    dp: int
    """Ranks the actor's weights, gradients and optimizer state are sharded over."""
    tp: int
    replicas: int
    colocated: bool
    """True: every role has a rank on every GPU (FSDP worker groups); False: one GPU per role."""

    @property
    def world(self) -> int:
        """GPUs (CPU: processes per role) of the cluster."""
        return self.nnodes * self.per_node


def _plan_device(cfg: Any) -> str:
    device = str(cfg.trainer.device)
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_layout(cfg: Any, *, dp: int = 1, device: str | None = None) -> Layout:
    """The layout `dapo train` runs `cfg` with; `dp` is the ZeRO what-if of one-process engines."""
    dev = device or _plan_device(cfg)
    tr, arr = cfg.trainer, cfg.actor_rollout_ref
    nnodes, per_node = int(tr.nnodes), int(tr.n_gpus_per_node)
    strategy = str(arr.actor.strategy)
    tp = int(arr.rollout.tensor_model_parallel_size) if arr.rollout.name == "vllm" else 1
    if strategy in FSDP_STRATEGIES:
        world = nnodes * per_node
        return Layout(dev, nnodes, per_node, strategy, world, tp, max(1, world // tp), True)
    return Layout(dev, nnodes, per_node, strategy, dp, tp, max(1, nnodes * per_node // tp), False)


def _layout_line(lay: Layout) -> str:
    unit = "GPUs" if lay.device == "cuda" else "processes"
    if lay.colocated:
        return (
            f"layout: {lay.nnodes} node(s) × {lay.per_node} {unit} = {lay.world}; actor ({lay.strategy}) "
            f"sharded over dp={lay.dp}" + f"; {lay.replicas} rollout "
            f"replica(s) of tp={lay.tp}; every GPU holds an actor rank and a rollout shard (colocated)"
        )
    return (
        f"layout: one {'GPU' if lay.device == 'cuda' else 'process'} per training role "
        f"({lay.strategy} engine; ZeRO dp={lay.dp}"
        + (" what-if" if lay.dp > 1 else "")
        + f"); {lay.replicas} rollout replica(s) of tp={lay.tp} on {unit} of their own "
        f"(trainer.nnodes × n_gpus_per_node = {lay.world})"
    )
