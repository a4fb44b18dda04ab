"""Rollout replicas: `M` rollout engines, each generating a share of a stage's prompt groups.

`M = trainer.nnodes × trainer.n_gpus_per_node // rollout.tensor_model_parallel_size` (`replica_layout`: every
device belongs to one replica, as verl lays it out; on CPU `n_gpus_per_node` counts processes per node); each
replica is a named worker `rollout-<i>`. A stage's rows are split by whole groups (all rows of a uid on one
replica), largest expected tokens first (`split_groups`); each commits its share as `<stage>_r<i>of<M>`
(an earlier attempt's share is reused only if made with the current weights) and the driver commits the stage
as a row selection over the shares in input order (`gather_positions`): no generated table passes through the
driver, no row is lost or duplicated; a single share is committed as the stage itself. Seeds derive from the
uid, so the tokens do not depend on the split (log-probs to float precision: a share pads to its own longest
prompt). `push_from` streams the actor's weights to every replica and records the version each reports; a
replica that did not confirm the current version is never used (`StaleWeights`), and each checks again when it
generates. Device seam, `replica_layout`: tensor parallelism (vLLM; a replica reserves TP GPUs and runs its TP
ranks with vLLM's multiprocessing executor) is GPU-only, refused on CPU and for the HF engine. On a colocated
pool (`dapo_core.compute.pools`) a replica shares its GPUs with the training ranks and frees its memory while
they run (`release`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.compute.cluster import Cluster, WorkerSpec
from dapo_core.compute.placement import checked_resources
from dapo_core.compute.pools import DevicePool
from dapo_core.compute.rpc import Future, group_size, handle_of, proxy, submit
from dapo_core.compute.weight_transport import plan_links
from dapo_core.compute.workers.rollout import RolloutWorker, StaleWeights
from dapo_core.errors import DapoUserError
from dapo_core.store.jobs import StageJob, stage_files

__all__ = [
    "PendingStage",
    "ReplicaLayout",
    "RolloutReplicas",
    "StaleWeights",
    "create_replicas",
    "gather_positions",
    "link_kind",
    "replica_layout",
    "replica_role",
    "split_groups",
]

StageResult = tuple[str, dict[str, float]]

LEFTOVER_GRACE_S = 60.0
"""How long `create_replicas` waits for room the workers of a crashed driver still hold before refusing."""


def link_kind(
    requested: str,
    actor_ranks: int,
    actor_where: Sequence[Mapping[str, Any]],
    replica_where: Sequence[Mapping[str, Any]],
) -> str:
    """The kind of link a push uses (`dapo_core.compute.weight_transport`): `requested` unless `auto`;
    `auto` is `same_device` when there are at least as many actor ranks as replicas and actor rank i shares
    replica i's node and GPUs, else `broadcast`. A `same_device` request that cannot hold is refused."""
    pairs = list(zip(actor_where, replica_where, strict=False))
    fits = actor_ranks >= len(replica_where) and len(pairs) == len(replica_where)
    same = fits and all(
        a.get("node_id") == r.get("node_id") and list(a.get("gpus") or []) == list(r.get("gpus") or [])
        for a, r in pairs
    )
    if requested == "auto":
        return "same_device" if same else "broadcast"
    if requested == "same_device" and not same:
        raise DapoUserError(
            f"actor_rollout_ref.rollout.weight_transport=same_device pairs actor rank i with rollout replica "
            f"i on one device, but the {actor_ranks} actor rank(s) and {len(replica_where)} replica(s) do "
            "not share devices that way",
            where="actor_rollout_ref.rollout.weight_transport",
            fix="set it to auto (or broadcast), or give the actor as many ranks as there are replicas",
        )
    return requested


def replica_role(rank: int) -> str:
    """The worker role (and Ray actor name suffix, `dapo/<run_id>/rollout-<rank>`) of replica `rank`."""
    return f"rollout-{rank}"


@dataclass(frozen=True)
class ReplicaLayout:
    """How the rollout role is laid out over the devices."""

    count: int
    """M, the number of replicas."""
    tensor_parallel: int
    """Devices (tensor-parallel ranks) of one replica."""
    num_gpus: float
    """Ray GPUs one replica reserves (0 on CPU)."""
    engine_opts: dict[str, Any]
    """Engine options the layout adds (vLLM's executor for TP > 1)."""


def replica_layout(nnodes: int, n_gpus_per_node: int, tp: int, engine: str, device: str) -> ReplicaLayout:
    """The replicas of `nnodes × n_gpus_per_node` devices with `tp` devices each, or one `DapoUserError`
    paragraph when the numbers do not divide or tensor parallelism cannot run (CPU, HF engine).

    On GPU a replica with TP > 1 reserves `tp` GPUs for its Ray actor and vLLM starts its TP ranks on them
    with its multiprocessing executor (`distributed_executor_backend="mp"`; vLLM's Ray executor would ask Ray
    for GPUs the replica already holds). This path needs several GPUs and is not exercised on CPU. The
    replicas then hold every GPU of the cluster in Ray's accounting, so the training roles need GPUs of their
    own, unless the run is colocated (`dapo_core.compute.pools`), where the replicas take a share of each."""
    world = int(nnodes) * int(n_gpus_per_node)
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if tp < 1 or world < 1 or world % tp:
        raise DapoUserError(
            f"{key}={tp} does not divide the {world} devices of trainer.nnodes={nnodes} × "
            f"trainer.n_gpus_per_node={n_gpus_per_node}: every rollout replica takes {key} devices and "
            f"every device belongs to one replica",
            where=key,
            fix=f"choose a {key} that divides {world} (e.g. 1), or change trainer.n_gpus_per_node",
        )
    if tp > 1 and device == "cpu":
        raise DapoUserError(
            f"{key}={tp} asks for tensor-parallel rollout engines, which need GPUs; this run is on CPU, "
            f"where trainer.n_gpus_per_node counts processes and each rollout replica is one process",
            where=key,
            fix=f"set {key}=1 on CPU (trainer.n_gpus_per_node then sets the number of rollout replicas)",
        )
    if tp > 1 and engine != "vllm":
        raise DapoUserError(
            f"{key}={tp} needs the vllm engine: actor_rollout_ref.rollout.name={engine!r} has no tensor "
            f"parallelism",
            where=key,
            fix=f"set actor_rollout_ref.rollout.name=vllm, or {key}=1",
        )
    opts: dict[str, Any] = {"distributed_executor_backend": "mp"} if tp > 1 else {}
    return ReplicaLayout(world // tp, tp, float(tp) if device != "cpu" else 0.0, opts)


def split_groups(groups: Sequence[Hashable], costs: Sequence[float] | np.ndarray, m: int) -> list[np.ndarray]:
    """Row positions of `m` shares: each group (the rows with equal `groups[i]`) whole in one share, groups
    dealt largest total cost first (ties: first in the input) to the share with the least cost so far (ties:
    the lower share); each share's rows in input order (some shares are empty when there are fewer groups)."""
    if m < 1:
        raise ValueError(f"split_groups: m must be >= 1, got {m}")
    codes: dict[Hashable, int] = {}
    row_group = np.fromiter((codes.setdefault(g, len(codes)) for g in groups), dtype=np.int64)
    cost = np.bincount(row_group, weights=np.asarray(costs, dtype=np.float64), minlength=len(codes))
    owner = np.zeros(len(codes), dtype=np.int64)
    loads = [(0.0, r) for r in range(m)]
    for g in sorted(range(len(codes)), key=lambda g: (-cost[g], g)):
        load, r = heapq.heappop(loads)
        owner[g] = r
        heapq.heappush(loads, (load + float(cost[g]), r))
    row_owner = owner[row_group]
    return [np.flatnonzero(row_owner == r) for r in range(m)]


def gather_positions(shares: Sequence[np.ndarray], total: int) -> np.ndarray:
    """Positions in the concatenated shares (in share order) that restore the input order of `total` rows;
    raises when the shares lose or duplicate a row."""
    order = (
        np.concatenate([np.asarray(s, dtype=np.int64) for s in shares]) if shares else np.zeros(0, np.int64)
    )
    if len(order) != total or not np.array_equal(np.sort(order), np.arange(total)):
        raise RuntimeError(f"rollout shares cover {len(order)} rows, not each of the {total} input rows once")
    return np.argsort(order, kind="stable")


class PendingStage:
    """A generation stage handed to the replicas and not collected yet; `result()` waits for every share and
    commits the stage (once), returning its URI and metrics."""

    def __init__(self, finish: Callable[[], StageResult]) -> None:
        self._finish = finish
        self._done: StageResult | None = None

    def result(self) -> StageResult:
        """Wait for the replicas, commit the gathered stage (first call only) and return (URI, metrics)."""
        if self._done is None:
            self._done = self._finish()
        return self._done


class RolloutReplicas:
    """The rollout role: `RolloutWorker` replicas (proxies) behind the calls the tasks make.

    `names` are the replicas' worker roles; `placement` maps a role to its Ray node (`Cluster.placement`);
    `max_new_tokens` sizes a row's expected tokens for the split. The replicas must hold one weight version.
    """

    def __init__(
        self,
        workers: Sequence[RolloutWorker],
        *,
        max_new_tokens: int,
        names: Sequence[str] | None = None,
        placement: Mapping[str, Mapping[str, Any]] | None = None,
        tensor_parallel: int = 1,
        colocated: bool = False,
    ) -> None:
        if not workers:
            raise ValueError("RolloutReplicas needs at least one replica")
        self.workers = list(workers)
        self.names = list(names) if names is not None else [replica_role(i) for i in range(len(workers))]
        self.max_new_tokens = int(max_new_tokens)
        self.placement = placement if placement is not None else {}
        self.tensor_parallel = int(tensor_parallel)
        self.colocated = bool(colocated)
        """The replicas share their GPUs with the training ranks: `release` frees their memory."""
        self.versions: list[int | None] = [w.weight_version() for w in self.workers]
        """The weight version each replica reported last (None: it did not confirm the last push)."""
        if len(set(self.versions)) != 1:
            raise RuntimeError(f"rollout replicas start with different weight versions {self.versions}")
        self.weight_version: int = int(self.versions[0] or 0)
        """The version pushed last to every replica: the only one generation may use."""
        self.last_push: dict[str, float] = {}
        """The last push's figures (`weight_sync/*`: bytes, buckets, largest message, seconds)."""

    def __len__(self) -> int:
        return len(self.workers)

    # ------------------------------------------------------------------ weights
    def push_from(
        self,
        actor: Any,
        version: int,
        *,
        transport: str = "auto",
        bucket_bytes: int = 512 << 20,
        actor_where: Sequence[Mapping[str, Any]] = (),
    ) -> int:
        """Stream the weights of `actor` (an `ActorWorker` proxy: one process or a group of ranks) into
        every replica and stamp them `version`; returns it. Each replica reports its version; until all have
        confirmed `version`, none is used.

        Under Ray the tensors go straight from the actor's ranks to the replicas in buckets of
        `bucket_bytes` (`dapo_core.compute.weight_transport`), never through the object store or the driver:
        `same_device` links pair actor rank i with replica i where they share a device (`actor_where[i]`,
        the ranks' node and GPUs, against the replica's placement), else one `broadcast` link from rank 0.
        `transport` forces one kind (`auto` chooses). In-process, the replica loads the actor's tensors as
        they are produced (the figures: the bytes one replica loaded, and the seconds). The push's figures
        are kept in `last_push` (`weight_sync/*`)."""
        self.versions = [None] * len(self.workers)
        if not (handle_of(actor).is_ray and all(handle_of(w).is_ray for w in self.workers)):
            pushed = [0]

            def counted(items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
                for name, t in items:
                    pushed[0] += t.numel() * t.element_size()
                    yield name, t

            t0 = time.perf_counter()
            for w in self.workers:
                pushed[0] = 0  # the figure is one replica's load, as a push from rank 0 reports its own
                w.sync_weights(counted(actor.sync_tensors()))
            seconds = time.perf_counter() - t0
            self.last_push = {"weight_sync/bytes": float(pushed[0]), "weight_sync/seconds": seconds}
            return self.set_weight_version(version)
        ends = [f.result() for f in [submit(w.weight_endpoint) for w in self.workers]]
        ranks = group_size(actor)
        kind = link_kind(transport, ranks, list(actor_where), [self.placement.get(n, {}) for n in self.names])
        links = plan_links(
            kind,
            ranks,
            [(e["host"], int(e["port"])) for e in ends],
            bucket_bytes=int(bucket_bytes),
            dtype=str(ends[0]["dtype"]),
            device=str(ends[0]["device"]),
            tag=f"push-{version}-{uuid.uuid4().hex[:8]}",
        )
        specs = [dataclasses.asdict(link) for link in links]
        started: list[Future[dict[str, float]]] = [submit(actor.send_weights, specs, str(ends[0]["dtype"]))]
        for i, w in enumerate(self.workers):
            link, index = (specs[i], 0) if kind == "same_device" else (specs[0], i)
            started.append(submit(w.receive_weights, link, index))
        outcomes: list[Any] = []
        for f in started:  # every end is waited for, so no call is left running when one failed
            try:
                outcomes.append(f.result())
            except Exception as exc:
                outcomes.append(exc)
        failed = [o for o in outcomes if isinstance(o, Exception)]
        if failed:
            raise failed[0]
        sent = outcomes[0]
        self.last_push = {
            **sent,
            "weight_sync/max_message_bytes": max(o["weight_sync/max_message_bytes"] for o in outcomes),
            "weight_sync/same_device": float(kind == "same_device"),
        }
        return self.set_weight_version(version)

    def set_weight_version(self, version: int) -> int:
        """Stamp every replica's current weights `version` (no weights move) and record the versions they
        report; returns it."""
        self.versions = [None] * len(self.workers)
        self.weight_version = int(version)
        stamped = [submit(w.set_weight_version, int(version)) for w in self.workers]
        self.versions = [int(f.result()) for f in stamped]
        self.check_versions()
        return self.weight_version

    def check_versions(self) -> None:
        """Raise `StaleWeights` naming every replica that did not report the current weight version."""
        stale = [
            f"{self.names[i]} (version {v})" for i, v in enumerate(self.versions) if v != self.weight_version
        ]
        if stale:
            raise StaleWeights(
                f"rollout replicas {', '.join(stale)} did not confirm weight version {self.weight_version}; "
                f"refusing to generate with stale weights",
                fix="resume the run (new rollout replicas load the checkpoint's weights)",
            )

    def release(self) -> None:
        """Before the training stages of a colocated layout: every replica frees its engine's GPU memory
        (`RolloutWorker.release_memory`; the next weight push or generation takes it back). No-op when the
        replicas have devices of their own."""
        if self.colocated:
            for f in [submit(w.release_memory) for w in self.workers]:
                f.result()

    # ------------------------------------------------------------------ generation
    def generate(self, table: pa.Table, gen_step: int, validate: bool = False) -> pa.Table:
        """`RolloutWorker.generate` over the replicas: whole groups per replica, the rows back in the order of
        `table` (the tables pass through this process; the stages below do not)."""
        self.check_versions()
        lens = pc.list_value_length(table.column("prompt_ids")).to_numpy(zero_copy_only=False)
        shares = split_groups(table.column("uid").to_pylist(), lens + self.max_new_tokens, len(self))
        live = [(w, s) for w, s in zip(self.workers, shares, strict=True) if len(s)]
        started = [
            submit(w.generate, table.take(pa.array(s)), gen_step, validate, self.weight_version)
            for w, s in live
        ]
        outs = [f.result() for f in started]
        if len(outs) == 1:
            return outs[0]
        whole = pa.concat_tables(outs)
        return whole.take(pa.array(gather_positions([s for _, s in live], table.num_rows)))

    def generate_stage(self, job: StageJob, gen_step: int) -> StageResult:
        """`RolloutWorker.generate_stage` over the replicas (see `submit_generate_stage`), waited for."""
        return self.submit_generate_stage(job, gen_step).result()

    def submit_generate_stage(self, job: StageJob, gen_step: int) -> PendingStage:
        """Start generating the prompt rows at `job.input_uri` on the replicas (one share of whole groups
        each) without waiting; the returned `PendingStage` commits `job.stage` when collected."""
        return self._launch(job, gen_step, None, None)

    def validation_stage(self, job: StageJob, gen_step: int, *, n: int, uid_seed: int) -> StageResult:
        """`RolloutWorker.validation_stage` over the replicas: each held-out prompt's `n` rows on one
        replica; committed as `job.stage`."""
        return self._launch(job, gen_step, n, uid_seed).result()

    def _launch(self, job: StageJob, gen_step: int, n: int | None, uid_seed: int | None) -> PendingStage:
        """Hand the shares of `job` to the replicas (validation when `n` is given: the prompts at the input
        are repeated `n` times by each replica, which keeps its own rows of the repeated table)."""
        self.check_versions()
        version = self.weight_version

        def start(w: RolloutWorker, j: StageJob, rows: list[int] | None) -> Future[StageResult]:
            if n is None:
                return submit(w.generate_stage, j, gen_step, rows, version)
            assert uid_seed is not None
            return submit(
                w.validation_stage, j, gen_step, n=n, uid_seed=uid_seed, rows=rows, expect_version=version
            )

        if len(self) == 1:
            only = start(self.workers[0], job, None)
            return PendingStage(only.result)
        files = stage_files(job.root)
        t0 = time.perf_counter()
        if n is None:
            ids = files.read_uri(job.input_uri, verify=False, columns=["uid", "prompt_ids"])
            groups: list[Any] = ids.column("uid").to_pylist()
            lens = pc.list_value_length(ids.column("prompt_ids")).to_numpy(zero_copy_only=False)
        else:
            ids = files.read_uri(job.input_uri, verify=False, columns=["prompt_ids"])
            plens = pc.list_value_length(ids.column("prompt_ids")).to_numpy(zero_copy_only=False)
            groups, lens = list(np.repeat(np.arange(len(plens)), n)), np.repeat(plens, n)
        shares = split_groups(groups, lens + self.max_new_tokens, len(self))
        live = [(i, s) for i, s in enumerate(shares) if len(s)]
        if len(live) <= 1:  # every row (or none) on one replica: it commits the stage itself
            only = start(self.workers[live[0][0] if live else 0], job, None)
            return PendingStage(only.result)
        parts: list[tuple[np.ndarray, str, Future[StageResult] | StageResult]] = []
        for i, rows in live:
            share_meta = {"replica": i, "weight_version": version}
            sub = dataclasses.replace(job, stage=f"{job.stage}_r{i}of{len(self)}", meta=share_meta)
            meta = (files.meta(job.step, sub.stage) or {}) if files.is_committed(job.step, sub.stage) else {}
            if meta.get("weight_version") == version:  # an earlier attempt's share
                done: StageResult = (files.stage_uri(job.step, sub.stage), dict(meta.get("metrics", {})))
                parts.append((rows, sub.stage, done))
            else:
                parts.append((rows, sub.stage, start(self.workers[i], sub, rows.tolist())))

        def finish() -> StageResult:
            results = [p.result() if isinstance(p, Future) else p for _, _, p in parts]
            positions = gather_positions([rows for rows, _, _ in parts], len(groups))
            metrics = _merged_metrics([len(rows) for rows, _, _ in parts], [m for _, m in results])
            metrics[f"timing_s/{job.timer}"] = time.perf_counter() - t0
            meta = {**job.meta, "metrics": metrics, "replicas": len(self)}
            uri = files.write_selection(
                job.step, job.stage, positions, base=[u for u, _ in results], meta=meta
            )
            return uri, metrics

        return PendingStage(finish)

    # ------------------------------------------------------------------ bookkeeping
    def workers_info(self) -> list[dict[str, Any]]:
        """One entry per replica for `runs/<id>/workers.json`: role `rollout`, rank, worker name, devices
        (tensor-parallel ranks) and the Ray node (`node_id`, `node_ip`; absent for in-process workers)."""
        return [
            {
                "role": "rollout",
                "rank": i,
                "name": name,
                "devices": self.tensor_parallel,
                **self.placement.get(name, {}),
            }
            for i, name in enumerate(self.names)
        ]

    def close(self) -> None:
        """Release every replica's engine (the cluster kills Ray replicas itself)."""
        for w in self.workers:
            w.close()


def _merged_metrics(rows: list[int], parts: list[dict[str, float]]) -> dict[str, float]:
    """The generation metrics of the whole stage from its shares' (`generation_metrics`; none for
    validation): generated tokens summed, the mean response length over all rows."""
    if not all("perf/gen_tokens" in m for m in parts):
        return {}
    tokens = sum(int(m["perf/gen_tokens"]) for m in parts)
    return {"response_length/gen_mean": float(tokens / max(sum(rows), 1)), "perf/gen_tokens": float(tokens)}


def create_replicas(
    cluster: Cluster,
    factory: Callable[[int | None, str | None], Callable[[], RolloutWorker]],
    layout: ReplicaLayout,
    *,
    max_new_tokens: int,
    resources: Mapping[str, Any] | None = None,
    pool: DevicePool | None = None,
) -> RolloutReplicas:
    """Create `layout.count` replicas as workers `rollout-<i>` (`factory(num_threads, visible_devices)`
    returns a replica's zero-argument worker factory). Under Ray each replica holds one logical CPU (and
    `layout.num_gpus` GPUs) and, on CPU, `cluster.num_threads // M` torch threads (at least one). Replicas
    left by a crashed driver of the run are killed first; a cluster without room for all of them within
    `LEFTOVER_GRACE_S` is refused with one paragraph instead of waiting for resources that never come. On a
    colocated `pool`, replica `i` shares the GPUs of its bundles (`PoolLayout.replica_bundles`) and its
    engine sees those devices (`visible_devices`, for TP > 1)."""
    m = layout.count
    where = checked_resources("rollout", resources)
    threads = max(1, cluster.num_threads // m) if cluster.use_ray and layout.num_gpus == 0 else None
    names = [replica_role(i) for i in range(m)]
    if pool is not None and pool.layout.replicas != m:
        raise ValueError(f"{m} replicas but the pool holds {pool.layout.replicas}")
    if pool is not None:  # a stale replica of the same name is replaced by `Cluster.create`
        tp = pool.layout.tp
        specs = [
            WorkerSpec(
                name,
                factory(None, pool.visible_devices(i) if tp > 1 else None),
                num_gpus=pool.layout.fraction,
                scheduling_strategy=pool.strategy(pool.layout.replica_bundles(i)[0]),
            )
            for i, name in enumerate(names)
        ]
        workers = [proxy(h, RolloutWorker) for h in cluster.create_many(specs)]
        if tp > 1:  # Ray knows the replica's share of its first GPU; its engine runs on all of its bundles'
            for i, name in enumerate(names):
                cluster.placement[name] = {
                    **cluster.placement[name],
                    "gpus": pool.visible_devices(i).split(","),
                }
    else:
        workers = _plain_replicas(cluster, factory, layout, names, where, threads)
    return RolloutReplicas(
        workers,
        max_new_tokens=max_new_tokens,
        names=names,
        placement=cluster.placement,
        tensor_parallel=layout.tensor_parallel,
        colocated=pool is not None,
    )


def _plain_replicas(
    cluster: Cluster,
    factory: Callable[[int | None, str | None], Callable[[], RolloutWorker]],
    layout: ReplicaLayout,
    names: list[str],
    where: dict[str, float],
    threads: int | None,
) -> list[RolloutWorker]:
    """The replicas on devices of their own, after making room that a crashed driver's replicas held."""
    m = len(names)
    if cluster.use_ray:
        import ray

        from dapo_core.compute.cluster import NAMESPACE, actor_name

        for name in names:  # replicas a crashed driver left: their resources are freed while we look
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(actor_name(cluster.run_id, name), namespace=NAMESPACE))
        need = {"CPU": float(m), **({"GPU": layout.num_gpus * m} if layout.num_gpus else {})}
        need.update({k: v * m for k, v in where.items()})
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while True:  # a dead driver's workers release theirs only once Ray has noticed it died
            free = ray.available_resources()
            if all(free.get(k, 0.0) >= v for k, v in need.items()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not all(free.get(k, 0.0) >= v for k, v in need.items()):
            raise DapoUserError(
                f"{m} rollout replicas need {', '.join(f'{k}={v:g}' for k, v in need.items())} of the Ray "
                f"cluster, which has {', '.join(f'{k}={free.get(k, 0.0):g}' for k in need)} free",
                where="trainer.n_gpus_per_node",
                fix=(
                    "lower trainer.n_gpus_per_node (it sets the number of rollout replicas), or give Ray "
                    "more (RAY_ADDRESS / ray start --num-cpus / --num-gpus, infra/ray_cluster.sh)"
                ),
            )
    specs = [WorkerSpec(n, factory(threads, None), num_gpus=layout.num_gpus, resources=where) for n in names]
    return [proxy(h, RolloutWorker) for h in cluster.create_many(specs)]
