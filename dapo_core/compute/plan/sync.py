"""The weight push after each update: how the weights travel (`_Push`: same_device or broadcast, buckets,
dtype), the rows it adds to a sending actor rank and a receiving replica, and its bytes and estimated seconds
per step (`SyncPlan`) at the assumed bandwidths of this module's constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo_core.compute.plan.layout import Layout, _opt
from dapo_core.compute.plan.shape import _DTYPE_NAMES, LoraShape, ModelShape, _gib
from dapo_core.compute.plan.states import FSDP_BYTES
from dapo_core.compute.plan.tables import RolePlan, Row
from dapo_core.compute.plan_advice import FSDP_STRATEGIES

NVLINK_BYTES_PER_S = 200e9
"""Assumed bandwidth of a collective inside a node: NCCL's all-gather bus bandwidth over NVLink 3 on 8 A100s
is about 230 GB/s in nccl-tests (NVLink 4 on H100 about twice it)."""
NETWORK_BYTES_PER_S = 25e9
"""Assumed bandwidth between nodes per GPU: one 200 Gb/s InfiniBand HCA per GPU (DGX A100; DGX H100 has
400 Gb/s)."""
DEVICE_COPY_BYTES_PER_S = 1e12
"""Assumed bandwidth of a copy within one GPU: a copy reads and writes, so about half of the HBM bandwidth
(2 TB/s on an A100 80GB)."""
HOST_COPY_BYTES_PER_S = 8e9
"""Bandwidth of a copy in host memory by one core: torch's copy_ of 256 MiB measured 8.7 GB/s on the 2-core
CPU machine of the tests (assumed for other hosts)."""
LOOPBACK_BYTES_PER_S = 1e9
"""Assumed bandwidth of a gloo collective between processes of one host (TCP over the loopback device)."""
LINK_GROUP_BYTES = 4 << 20
"""Resident memory a CPU process adds for a push's link: its gloo group, TCPStore and their threads (2.5-3.5
MiB measured on the tests' CPU machine beside the buckets; tests/unit/dapo_core/compute/plan/test_sync.py)."""
SAME_DEVICE_COPIES = 4
"""Copies of every byte on a same-device link: into the bucket, into the shared buffer, out of it, into the
rollout's model (`weight_transport.send_all` / `receive_into`)."""


@dataclass(frozen=True)
class _Push:
    """How the weights travel to the rollout after an update (`weight_transport`, `push_from`)."""

    kind: str
    """`same_device` (actor rank i feeds replica i through shared memory) or `broadcast` (rank 0 to all)."""
    links: int
    """Links of one push: one per replica (same_device) or one (broadcast)."""
    receivers: int
    """Replicas fed."""
    dtype_bytes: int
    """Bytes per value of the push dtype: the rollout engine's weight dtype."""
    bucket: int
    """`update_weights_bucket_megabytes` in bytes: the largest message."""
    fill: int
    """The most bytes one bucket holds: min(bucket, P·b + 64 B alignment per tensor)."""
    alloc: int
    """Resident bytes of one bucket buffer: the whole bucket on GPU (allocated at once), its touched pages
    (`fill`) on CPU."""
    largest: int
    """Bytes of the largest tensor in the push dtype."""
    params: int
    """P, the values of one push."""

    @property
    def per_link(self) -> int:
        """Tensor bytes a link carries per push: P·b."""
        return self.params * self.dtype_bytes


def _rollout_dtype_bytes(cfg: Any, lay: Layout) -> int:
    """Bytes per value of the rollout engine's weights (what a push casts to): `rollout.dtype`, else vLLM's
    bf16 on GPU, float32 for the HF engine and on CPU."""
    ro = cfg.actor_rollout_ref.rollout
    default = 2 if ro.name == "vllm" and lay.device == "cuda" else 4
    return _DTYPE_NAMES.get(str(ro.dtype), default)


def _push(cfg: Any, s: ModelShape, lay: Layout) -> _Push:
    """The push `RolloutReplicas.push_from` makes for this layout. `weight_transport: auto` is same_device
    where actor rank i shares replica i's devices (colocated with tp 1, or one actor process and one replica
    on one CPU host), else broadcast."""
    ro = cfg.actor_rollout_ref.rollout
    want = str(_opt(ro, "weight_transport", "auto"))
    ranks = lay.world if lay.colocated else 1
    one_host = lay.device == "cpu" and lay.nnodes == 1 and ranks >= lay.replicas
    same = lay.tp == 1 if lay.colocated else one_host
    kind = want if want != "auto" else ("same_device" if same else "broadcast")
    b = _rollout_dtype_bytes(cfg, lay)
    bucket = int(_opt(ro, "update_weights_bucket_megabytes", 512)) << 20
    fill = min(bucket, s.num_params * b + 64 * s.num_tensors)
    return _Push(
        kind=kind,
        links=lay.replicas if kind == "same_device" else 1,
        receivers=lay.replicas,
        dtype_bytes=b,
        bucket=bucket,
        fill=fill,
        alloc=bucket if lay.device == "cuda" else fill,
        largest=s.largest_params * b,
        params=s.num_params,
    )


def _fill_formula(push: _Push) -> str:
    return f"min(bucket, P·{push.dtype_bytes} B + 64 B·tensors) = {push.fill:,} B"


def _alloc_formula(push: _Push, gpu: bool) -> str:
    return f"bucket {push.bucket >> 20} MiB" if gpu else f"touched pages: {_fill_formula(push)}"


def _sender_rows(
    role: RolePlan, s: ModelShape, lay: Layout, push: _Push, weight_bytes: int, lora: LoraShape | None = None
) -> None:
    """The push's pass on an actor rank that sends (rank 0 of a broadcast; every rank of same_device links):
    the tensor in flight (FSDP2: its shard cast to the push dtype and all-gathered; one-process engines: a
    cast copy when the weights are not in the push dtype) and the bucket(s). On GPU they are device memory,
    on CPU the process's. With LoRA the pushed weights are merged (`lora.merged_tensors`): an adapted weight
    W + B·A in float32 beside its B·A, then cast to the push dtype (FSDP2: a rank's rows of them, then the
    cast rows all-gathered); a weight without adapters travels as without LoRA."""
    b, gpu = push.dtype_bytes, lay.device == "cuda"
    if not gpu:
        role.rows.append(_link_row())
    fsdp = lay.strategy in FSDP_STRATEGIES
    if lora is not None:
        dp, cast = lay.dp, b if weight_bytes != b else 0
        if fsdp:
            plain = s.largest_params * b + s.largest_params * b // dp
            merged = lora.largest_adapted * b + lora.largest_adapted * (8 + b) // dp
            formula = (
                f"max(largest·{b}·(1 + 1/dp), largest adapted·({b} + (4 + 4 + {b})/dp)) B: a weight without "
                "adapters cast and all-gathered; a rank's rows of an adapted one, W + B·A and B·A in "
                "float32, cast, all-gathered"
            )
        else:
            plain = s.largest_params * cast
            merged = lora.largest_adapted * (8 + cast)
            formula = (
                f"max(largest·{cast}, largest adapted·(4 + 4 + {cast})) B: W + B·A and B·A in float32"
                + (", cast to the push dtype" if cast else "")
            )
        role.rows.append(
            Row(
                "merged tensor",
                max(plain, merged),
                f"{formula} ({s.largest_params:,} and {lora.largest_adapted:,} values)",
                "sync",
            )
        )
    elif fsdp:
        role.rows.append(
            Row(
                "gathered tensor",
                push.largest + push.largest // lay.dp,
                f"largest·{b}·(1 + 1/dp): the largest tensor's shard cast to the push dtype, all-gathered "
                f"({s.largest_params:,} values)",
                "sync",
            )
        )
    elif weight_bytes != b:
        role.rows.append(
            Row("cast tensor", push.largest, f"largest·{b} B: one weight cast to the push dtype", "sync")
        )
    role.rows.append(
        Row("bucket", push.alloc, "the buffer tensors are packed into: " + _alloc_formula(push, gpu), "sync")
    )
    if push.kind == "same_device":
        where = "device memory shared by CUDA IPC" if gpu else "a /dev/shm file its replica maps"
        role.rows.append(Row("shared bucket", push.alloc, f"{where}: " + _alloc_formula(push, gpu), "sync"))


def _link_row() -> Row:
    return Row(
        "link group", LINK_GROUP_BYTES, "gloo group and TCPStore of the link (measured on CPU)", "sync"
    )


def _receiver_rows(role: RolePlan, lay: Layout, push: _Push, vllm: bool) -> None:
    """The push's pass on a rollout replica: the bucket it reads (its broadcast receive buffer; on CPU the
    sender's /dev/shm pages it maps, resident in both processes; on GPU same_device the sender's memory, not
    counted again), the tensors copied out of one bucket with the tensors split over buckets staged whole
    (the one a bucket completes and the one it starts), and for vLLM the group of at most a bucket (or one
    larger tensor) handed to its workers."""
    gpu = lay.device == "cuda"
    if not gpu:
        role.rows.append(_link_row())
    if push.kind == "broadcast":
        role.rows.append(
            Row(
                "receive bucket", push.alloc, "broadcast receive buffer: " + _alloc_formula(push, gpu), "sync"
            )
        )
    elif not gpu:
        role.rows.append(
            Row(
                "receive bucket",
                push.fill,
                "the sender's /dev/shm bucket, mapped: " + _fill_formula(push),
                "sync",
            )
        )
    role.rows.append(
        Row(
            "tensors copied out",
            push.fill + 2 * push.largest,
            f"one bucket's tensors + 2·largest·{push.dtype_bytes} B = {push.fill:,} + 2·{push.largest:,} "
            "(the tensor a bucket completes and the one it starts, each staged whole)",
            "sync",
        )
    )
    if vllm:
        role.rows.append(
            Row(
                "weight group",
                max(push.fill, push.largest),
                "max(bucket's fill, largest tensor): the tensors handed to vLLM's workers at once",
                "sync",
            )
        )


@dataclass
class SyncLine:
    """One figure of the weight push: bytes, the seconds they take at `bandwidth`, and how."""

    name: str
    bytes: int
    formula: str
    bandwidth: float = 0.0
    """Bytes per second assumed for it (0: not timed)."""
    link: str = ""
    """Which bandwidth: the module constant's name."""

    @property
    def seconds(self) -> float:
        return self.bytes / self.bandwidth if self.bandwidth else 0.0


@dataclass
class SyncPlan:
    """The weight push after every update (one per step): link kind, bytes and estimated seconds."""

    kind: str
    links: int
    receivers: int
    dtype_bytes: int
    bucket: int
    per_link: int
    """Tensor bytes one link carries per push (what `PushStats.bytes` reports): P·b."""
    lines: list[SyncLine] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """Estimated seconds of one push: the timed lines run one after the other."""
        return sum(x.seconds for x in self.lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "links": self.links,
            "receivers": self.receivers,
            "dtype_bytes": self.dtype_bytes,
            "bucket_bytes": self.bucket,
            "bytes_per_link": self.per_link,
            "seconds_per_step": self.seconds,
            "lines": [
                {
                    "name": x.name,
                    "bytes": x.bytes,
                    "seconds": x.seconds,
                    "bandwidth": x.bandwidth,
                    "link": x.link,
                }
                for x in self.lines
            ],
        }

    def render(self) -> list[str]:
        width = max(len(x.name) for x in self.lines)
        out = [
            f"[weight sync per step] ({self.kind}: {self.links} link(s) to {self.receivers} replica(s), "
            f"{self.dtype_bytes}-byte values, bucket {self.bucket >> 20} MiB)"
        ]
        for x in self.lines:
            t = f"{x.seconds:8.2f} s at {x.bandwidth / 1e9:g} GB/s ({x.link})" if x.bandwidth else ""
            out.append(f"  {x.name:<{width}} {_gib(x.bytes):>11}  {t}")
            out.append(f"  {'':<{width}}   = {x.formula}")
        out.append(f"  {'total':<{width}} {'':>11}  {self.seconds:8.2f} s per step (one push per step)")
        out.append("")
        return out


def _sync_plan(s: ModelShape, lay: Layout, push: _Push, lora: LoraShape | None = None) -> SyncPlan:
    """Bytes and seconds of one push at the assumed bandwidths: the FSDP2 all-gather each rank takes part
    in (with LoRA: the merged weights' rows and each adapter's A), then the links
    (same_device: every rank copies into its replica at once; broadcast: rank 0 sends once to every replica).
    The links carry the P merged weights, LoRA or not."""
    b, P = push.dtype_bytes, push.params
    sp = SyncPlan(push.kind, push.links, push.receivers, b, push.bucket, push.per_link)
    gpu, multi = lay.device == "cuda", lay.nnodes > 1
    intra = (
        (NVLINK_BYTES_PER_S, "NVLINK_BYTES_PER_S") if gpu else (LOOPBACK_BYTES_PER_S, "LOOPBACK_BYTES_PER_S")
    )
    link = (NETWORK_BYTES_PER_S, "NETWORK_BYTES_PER_S") if multi else intra
    if lay.strategy in FSDP_STRATEGIES and lay.dp > 1 and lora is not None:
        bw, name = link
        wb = FSDP_BYTES
        sp.lines.append(
            SyncLine(
                "all-gather per rank",
                (lay.dp - 1) * (P * b + lora.a_params * wb) // lay.dp,
                f"(dp−1)/dp·(P·{b} + A·{wb}) B = {lay.dp - 1}/{lay.dp}·({P:,}·{b} + {lora.a_params:,}·{wb}) "
                "(FSDP2, the merged rows in the push dtype; each adapter's A whole, in the shards' dtype)",
                bw,
                name,
            )
        )
    elif lay.strategy in FSDP_STRATEGIES and lay.dp > 1:
        bw, name = link
        sp.lines.append(
            SyncLine(
                "all-gather per rank",
                (lay.dp - 1) * P * b // lay.dp,
                f"(dp−1)/dp·P·{b} B = {lay.dp - 1}/{lay.dp}·{P:,}·{b} (FSDP2, in the push dtype)",
                bw,
                name,
            )
        )
    if push.kind == "same_device":
        bw, name = (
            (DEVICE_COPY_BYTES_PER_S, "DEVICE_COPY_BYTES_PER_S")
            if gpu
            else (
                HOST_COPY_BYTES_PER_S,
                "HOST_COPY_BYTES_PER_S",
            )
        )
        sp.lines.append(
            SyncLine(
                "bytes per push",
                push.per_link * push.links,
                f"P·{b} B × {push.links} link(s): each rank feeds its replica",
            )
        )
        sp.lines.append(
            SyncLine(
                "copies per link",
                SAME_DEVICE_COPIES * push.per_link,
                f"{SAME_DEVICE_COPIES}·P·{b} B (into the bucket, the shared buffer, out, into the model); "
                "links in parallel",
                bw,
                name,
            )
        )
    else:
        bw, name = link
        sp.lines.append(
            SyncLine(
                "bytes per push",
                push.per_link,
                f"P·{b} B = {P:,}·{b}: rank 0 broadcasts once to {push.receivers} replica(s) "
                f"({'NCCL' if gpu else 'gloo'})",
                bw,
                name,
            )
        )
    return sp
