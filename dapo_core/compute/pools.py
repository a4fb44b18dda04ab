"""The colocated device pool: every GPU of the cluster shared by one rank of each training role and a rollout
shard, as verl's hybrid engine lays out its `global_pool`.

`DevicePool.create` reserves one Ray placement group per node (STRICT_PACK), one bundle per GPU
(`{"GPU": 1, "CPU": shares}`); bundle `i` of the pool is the cluster's GPU `i` (node `i // per_node`). A
colocated process asks for `1 / shares` of its bundle's GPU, so Ray puts the actor's rank `i`, the reference's
rank `i`, the critic's rank `i` and the rollout shard of GPU `i` on one device, and no two ranks of a role on
the same one. A replica of tensor-parallel size `tp` sits on bundle `i · tp` and runs its engine's TP ranks on
the GPUs of bundles `i · tp … i · tp + tp - 1` (`visible_devices`), which must lie on one node.

The rollout engine frees its GPU memory while the training roles run (`RolloutWorker.release_memory`). Ray's
logical GPUs make the placement testable on CPU (`tests/integration/test_colocated_pool.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dapo_core.errors import DapoUserError

__all__ = ["DevicePool", "PoolLayout", "pool_layout", "same_nodes"]


@dataclass(frozen=True)
class PoolLayout:
    """The shape of a colocated pool: `nnodes × per_node` GPUs, `shares` processes on each."""

    nnodes: int
    per_node: int
    shares: int
    """Processes that share one GPU: a rank of each training role plus the rollout shard."""
    tp: int
    """GPUs of one rollout replica (its engine's tensor-parallel ranks)."""

    @property
    def world(self) -> int:
        """GPUs in the pool."""
        return self.nnodes * self.per_node

    @property
    def fraction(self) -> float:
        """The share of its GPU a colocated process asks Ray for."""
        return 1.0 / self.shares

    @property
    def replicas(self) -> int:
        """Rollout replicas of the pool."""
        return self.world // self.tp

    def replica_bundles(self, replica: int) -> list[int]:
        """The pool's bundles (GPUs) that replica `replica` runs its tensor-parallel ranks on."""
        return list(range(replica * self.tp, (replica + 1) * self.tp))


def pool_layout(nnodes: int, per_node: int, training_roles: int, tp: int) -> PoolLayout:
    """The colocated pool of `nnodes × per_node` GPUs for `training_roles` data-parallel roles and rollout
    replicas of `tp` GPUs, or one `DapoUserError` paragraph when a replica would span two nodes."""
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if tp < 1 or per_node % tp:
        raise DapoUserError(
            f"{key}={tp} does not divide trainer.n_gpus_per_node={per_node}: in the colocated layout a "
            f"rollout replica runs its tensor-parallel ranks on GPUs of one node",
            where=key,
            fix=f"choose a {key} that divides {per_node} (verl's DAPO recipe uses 4 on 8-GPU nodes)",
        )
    return PoolLayout(int(nnodes), int(per_node), int(training_roles) + 1, int(tp))


def same_nodes(resources: Mapping[str, Mapping[str, Any] | None]) -> dict[str, float]:
    """The custom Ray resources of the pool's bundles: colocated roles share nodes, so every role's
    `trainer.ray_resources.<role>` must be empty or the same; returns that one request."""
    from dapo_core.compute.placement import checked_resources

    asked = {role: checked_resources(role, res) for role, res in resources.items()}
    distinct = {tuple(sorted(v.items())) for v in asked.values() if v}
    if len(distinct) > 1:
        parts = "; ".join(f"{role}: {v}" for role, v in asked.items() if v)
        raise DapoUserError(
            f"trainer.ray_resources asks for different nodes per role ({parts}), but with "
            f"actor_rollout_ref.actor.strategy=fsdp2 on GPU every GPU holds a rank of each training role and "
            f"a rollout shard (colocated), so all roles run on the same nodes",
            where="trainer.ray_resources",
            fix="give every role the same entry (or leave them empty), or use one GPU per role with "
            "actor_rollout_ref.actor.strategy=torch",
        )
    return dict(next(iter(distinct))) if distinct else {}


@dataclass
class DevicePool:
    """A reserved colocated pool (see the module docstring); `kill` releases its placement groups."""

    layout: PoolLayout
    groups: list[Any] = field(default_factory=list)
    """One Ray placement group per node, `per_node` GPU bundles each."""
    _devices: list[str] | None = None

    @classmethod
    def create(
        cls, layout: PoolLayout, *, resources: Mapping[str, float] | None = None, timeout_s: float = 600.0
    ) -> DevicePool:
        """Reserve the pool's bundles; a pool the cluster cannot grant within `timeout_s` is refused with
        one paragraph that names the GPUs asked for and the cluster's free resources."""
        import ray
        from ray.util.placement_group import placement_group

        from dapo_core.compute.placement import PlacementError
        from dapo_core.compute.signals import _ray_get

        bundle = {"GPU": 1.0, "CPU": float(layout.shares)}
        first = {**bundle, **dict(resources or {})}  # a node's custom resource is asked once per node
        pool = cls(layout)
        for _ in range(layout.nnodes):
            bundles = [dict(first)] + [dict(bundle) for _ in range(layout.per_node - 1)]
            pool.groups.append(placement_group(bundles, "STRICT_PACK"))
        try:
            for pg in pool.groups:
                _ray_get(pg.ready(), timeout=timeout_s)
        except TimeoutError:
            pool.kill()
            raise PlacementError(
                f"the colocated pool of {layout.nnodes} node(s) × {layout.per_node} GPU bundles of {first} "
                f"was not granted within {timeout_s:.0f}s; the cluster has {ray.available_resources()} free "
                f"(each node must offer trainer.n_gpus_per_node GPUs)",
                where="trainer.nnodes / trainer.n_gpus_per_node",
                fix="lower trainer.nnodes or trainer.n_gpus_per_node to what the cluster has, or free GPUs "
                "that other runs' workers hold",
            ) from None
        return pool

    def strategy(self, gpu: int) -> Any:
        """The Ray scheduling strategy that puts a process on the pool's GPU `gpu`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        per_node = self.layout.per_node
        return PlacementGroupSchedulingStrategy(
            placement_group=self.groups[gpu // per_node], placement_group_bundle_index=gpu % per_node
        )

    def devices(self) -> list[str]:
        """The device id (as CUDA_VISIBLE_DEVICES names it on its node) of every bundle, pool order; probed
        once with a task that asks for a sliver of each bundle's GPU."""
        if self._devices is None:
            import ray

            from dapo_core.compute.signals import _ray_get

            probe = ray.remote(num_cpus=0, num_gpus=1e-4)(_gpu_ids)
            refs = [
                probe.options(scheduling_strategy=self.strategy(i)).remote() for i in range(self.layout.world)
            ]
            self._devices = [",".join(_ray_get(r)) for r in refs]
        return self._devices

    def visible_devices(self, replica: int) -> str:
        """CUDA_VISIBLE_DEVICES for replica `replica`'s engine: the devices of its bundles, in TP order."""
        devices = self.devices()
        return ",".join(devices[b] for b in self.layout.replica_bundles(replica))

    def kill(self) -> None:
        """Release the placement groups (the processes placed in them must be killed first)."""
        import ray

        for pg in self.groups:
            ray.util.remove_placement_group(pg)
        self.groups.clear()


def _gpu_ids() -> list[str]:
    import ray

    return [str(i) for i in ray.get_gpu_ids()]
