"""Worker groups: one model role as `nnodes × n_gpus_per_node` Ray actors (ranks) that act as one worker.

`create_group` reserves a Ray placement group for the role (its own pool: one bundle per node, spread over
distinct nodes; on CPU a rank is a process with one core), or places rank `i` on GPU `i` of the colocated pool
the roles share (`dapo_core.compute.pools`), starts one `_RankHost` per rank, has rank 0 name a
rendezvous (its node address and the port of a store it already listens on) and builds the worker object on
every rank at once after the ranks joined their process group (`dapo_core.compute.dist.init_data_parallel`).

The driver uses the returned `GroupHandle` exactly like a single worker's `Handle` (`proxy`, `submit`,
`chain`): a call runs the same method with the same arguments on every rank (SPMD) and returns rank 0's
result once every rank has finished; a rank's exception is raised in the driver. The data split is the
workers' own: each rank reads the stage's input from the run store and takes its rows (`dist.dp_split`), and
rank 0 commits the stage, so no table passes through the driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dapo_core.compute import cluster as C
from dapo_core.compute import signals as S
from dapo_core.compute.host import HostOptions, _init_worker_process, _RayHost
from dapo_core.compute.placement import PlacementError, _node_summary, checked_resources
from dapo_core.compute.pools import DevicePool
from dapo_core.compute.rpc import Handle, WorkerHung

__all__ = ["GroupHandle", "GroupLayout", "create_group", "create_role"]


class _RankHost(_RayHost):
    """A rank of a group: joins the group's process group, then builds its worker object."""

    def __init__(self, opts: HostOptions) -> None:
        _init_worker_process(opts)
        self._free_cuda_cache = opts.free_cuda_cache
        self._obj = None
        self._store: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and the port of the rendezvous store this rank now listens on (asked of rank
        0, which keeps the store for its `build`)."""
        from dapo_core.compute.dist import listen_store, node_address

        address = node_address()
        self._store = listen_store(address)
        return address, int(self._store.port)

    def build(
        self, factory: Callable[[], Any], rank: int, size: int, address: str, port: int, device: str
    ) -> str:
        """Join the process group as `rank` of `size` and build the worker (every rank at once)."""
        from dapo_core.compute import dist

        dist.set_current(dist.init_data_parallel(rank, size, address, port, device, store=self._store))
        self._obj = factory()
        return "ok"


@dataclass
class GroupHandle(Handle):
    """The handle of a worker group: `submit` starts the call on every rank; `wait` returns rank 0's
    result after all ranks finished (raising the first error)."""

    ranks: list[Any] = field(default_factory=list)
    """The rank actors, rank 0 first."""
    placement_group: Any = None

    @property
    def is_ray(self) -> bool:
        return True

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return [r.call.remote(method, args, kwargs) for r in self.ranks]

    def wait(self, ref: Any, method: str = "a call") -> Any:
        results = _wait_all(ref, timeout=self._timeout(method))
        return results[0]

    def passable(self, ref: Any) -> Any:
        """Rank 0's ObjectRef, after every rank finished (so a failed rank is raised here, not left
        blocking rank 0 in a collective)."""
        _wait_all(ref, fetch_first=False, timeout=self._timeout("a call"))
        return ref[0]

    def _timeout(self, method: str) -> tuple[float, WorkerHung] | None:
        """`timeout_s` and the error raised when a rank has not finished by then (None: no limit)."""
        if self.timeout_s is None:
            return None
        return self.timeout_s, WorkerHung(self.role, method, self.timeout_s)

    def kill(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)


def _wait_all(
    refs: list[Any], fetch_first: bool = True, timeout: tuple[float, Exception] | None = None
) -> list[Any]:
    """Wait for every ref (stop signals honoured); raise the first failure, or `timeout`'s error once its
    seconds passed with a rank unfinished; results in rank order (rank 0's left unfetched, None, when not
    `fetch_first`)."""
    import time

    import ray

    t0 = time.monotonic()
    pending = list(refs)
    out: dict[int, Any] = {}
    index = {id(r): i for i, r in enumerate(refs)}
    S._IN_RAY_WAIT.append(1)
    try:
        while pending:
            S._check_stop()
            ready, pending = ray.wait(pending, num_returns=1, timeout=S._WAIT_POLL_S, fetch_local=False)
            for r in ready:
                i = index[id(r)]
                out[i] = ray.get(r) if (i or fetch_first) else None
            if pending and timeout is not None and time.monotonic() - t0 > timeout[0]:
                raise timeout[1]
    finally:
        S._IN_RAY_WAIT.pop()
    return [out[i] for i in range(len(refs))]


@dataclass(frozen=True)
class GroupLayout:
    """How many ranks a role has and where: `nnodes` nodes with `per_node` ranks each."""

    nnodes: int
    per_node: int

    @property
    def size(self) -> int:
        return self.nnodes * self.per_node


def _check_nodes(role: str, bundle: Mapping[str, float], layout: GroupLayout, nodes: list) -> None:
    alive = [n for n in nodes if n.get("Alive", True)]
    fit = [n for n in alive if all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items())]
    if len(fit) >= layout.nnodes:
        return
    have = "; ".join(_node_summary(n) for n in alive) or "no live node"
    raise PlacementError(
        f"the {role} group needs {layout.nnodes} node(s) each offering {dict(bundle)} "
        f"(trainer.nnodes={layout.nnodes} × trainer.n_gpus_per_node={layout.per_node} ranks), but only "
        f"{len(fit)} node(s) do; the cluster's nodes: {have}",
        where="trainer.nnodes / trainer.n_gpus_per_node",
        fix=(
            "lower trainer.nnodes or trainer.n_gpus_per_node to what the cluster has (on CPU a rank is a "
            "process with one core), or add nodes (infra/ray_cluster.sh join)"
        ),
    )


def create_group(
    cluster: C.Cluster,
    role: str,
    factory: Callable[[], Any],
    layout: GroupLayout,
    *,
    num_gpus: float = 0.0,
    resources: Mapping[str, Any] | None = None,
    pool: DevicePool | None = None,
) -> GroupHandle:
    """Start `role` as `layout.size` ranks in a placement group of `layout.nnodes` bundles (one per node,
    STRICT_SPREAD), join their process group and build `factory()` on each; records every rank in
    `cluster.workers`. With a colocated `pool`, rank `i` runs on the pool's GPU `i` with its share of it
    instead (`num_gpus` and `resources` are the pool's)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    per_rank_cpu = 1.0
    pg: Any = None
    if pool is None:
        custom = checked_resources(role, resources)
        bundle = {
            "CPU": per_rank_cpu * layout.per_node,
            **({"GPU": num_gpus * layout.per_node} if num_gpus else {}),
            **custom,
        }
        _check_nodes(role, bundle, layout, ray.nodes())
        pg = placement_group([dict(bundle) for _ in range(layout.nnodes)], strategy="STRICT_SPREAD")
        try:
            S._ray_get(pg.ready(), timeout=cluster.start_timeout_s)
        except TimeoutError:
            ray.util.remove_placement_group(pg)
            raise PlacementError(
                f"the {role} group's {layout.nnodes} bundle(s) of {bundle} were not granted within "
                f"{cluster.start_timeout_s:.0f}s; the cluster has {ray.available_resources()} free",
                where="trainer.nnodes / trainer.n_gpus_per_node",
                fix="free resources (other runs' workers hold them), or lower trainer.n_gpus_per_node",
            ) from None
    elif pool.layout.world != layout.size:
        raise ValueError(f"the {role} group has {layout.size} ranks but the pool {pool.layout.world} GPUs")

    def strategy(rank: int) -> Any:
        if pool is not None:
            return pool.strategy(rank)
        return PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank // layout.per_node
        )

    remote_cls: Any = ray.remote(_RankHost)
    ranks = []
    for rank in range(layout.size):
        name = f"{C.actor_name(cluster.run_id, role)}/{rank}"
        with contextlib.suppress(ValueError):  # a rank left by a crashed driver
            ray.kill(ray.get_actor(name, namespace=C.NAMESPACE))
        ranks.append(
            remote_cls.options(
                name=name,
                namespace=C.NAMESPACE,
                num_cpus=per_rank_cpu,
                num_gpus=pool.layout.fraction if pool is not None else num_gpus,
                max_concurrency=1,
                scheduling_strategy=strategy(rank),
            ).remote(cluster.host_options())
        )
    handle = GroupHandle(role=role, ranks=ranks, placement_group=pg, ray_actor=ranks[0])
    try:
        address, port = S._ray_get(ranks[0].rendezvous.remote(), timeout=cluster.start_timeout_s)
        _wait_all(
            [
                r.build.remote(factory, rank, layout.size, address, port, cluster.device)
                for rank, r in enumerate(ranks)
            ]
        )
        for rank, r in enumerate(ranks):
            where = S._ray_get(r.where.remote(), timeout=cluster.start_timeout_s)
            cluster.workers.append({"role": role, "rank": rank, **where})
    except BaseException:
        handle.kill()
        raise
    cluster.placement[role] = {k: v for k, v in cluster.workers[-layout.size].items() if k.startswith("node")}
    cluster.own(role, handle)
    return handle


def create_role(
    cluster: C.Cluster,
    role: str,
    factory: Callable[[], Any],
    *,
    nnodes: int = 1,
    per_node: int = 1,
    num_gpus: float = 0.0,
    resources: Mapping[str, Any] | None = None,
    pool: DevicePool | None = None,
) -> Handle:
    """The model role `role` as `nnodes × per_node` data-parallel ranks (`create_group`; on the colocated
    `pool`'s GPUs when given); one rank is a plain worker (`Cluster.create`). Several ranks need Ray."""
    if nnodes * per_node == 1 and pool is None:
        return cluster.create(role, factory, num_gpus=num_gpus, resources=resources)
    if not cluster.use_ray:
        raise PlacementError(
            f"the {role} worker would have {nnodes * per_node} data-parallel ranks, which run as Ray actors, "
            "but trainer.use_ray=false runs every worker in this process",
            where="trainer.nnodes / trainer.n_gpus_per_node",
            fix="set trainer.use_ray=true, or trainer.nnodes=1 and trainer.n_gpus_per_node=1",
        )
    return create_group(
        cluster,
        role,
        factory,
        GroupLayout(nnodes, per_node),
        num_gpus=num_gpus,
        resources=resources,
        pool=pool,
    )
