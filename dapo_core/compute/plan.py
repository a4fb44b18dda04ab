"""`dapo plan`: the memory of every role per GPU and per host, each row with the formula that gives it.

The layout is the config's: `trainer.nnodes × n_gpus_per_node` GPUs (processes on CPU). An FSDP actor
(`strategy: fsdp2`) shards weights, gradients and AdamW state over that whole world and shares every GPU with
a rollout replica of `tensor_model_parallel_size` GPUs (replicas = world // tp), as verl's hybrid engine does;
the torch and DeepSpeed engines run one process per role, each on a GPU of its own. `make_plan` returns the
per-role rows (what a process holds on its device: on CPU that is the process's resident memory), the sum for
a GPU shared by several roles, and the host RAM of each node. A role's peak is what it holds throughout plus
its largest pass; a "load" pass (weights arriving) stands alone. The weight push after each update is a
"sync" pass of its own (one tensor in flight and the buckets of `weight_transport`, never the whole model),
and `MemoryPlan.sync` gives its bytes and estimated seconds per step at assumed bandwidths (module
constants). `advise` (plan_advice.py) finds the config changes that make a failing check pass by
re-planning with each. `gpu_budget_problem` is the check that makes `dapo train` refuse a GPU config whose
per-GPU memory it does not know. Checked against measured peaks in tests/unit/dapo_core/compute/test_plan.py
(with a real push of a tiny model over `weight_transport`), bench/bench_plan.py (CPU) and
bench/gpu_memory_check.sh (GPU).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo_core.compute.peak_memory import rss_bytes
from dapo_core.compute.plan_advice import FSDP_STRATEGIES, search

__all__ = [
    "BUILTIN_SHAPES",
    "Layout",
    "MemoryPlan",
    "ModelShape",
    "PlanError",
    "RolePlan",
    "activation_bytes",
    "advise",
    "gpu_budget",
    "gpu_budget_problem",
    "host_memory",
    "host_ram_problem",
    "make_plan",
    "measure_actor_update",
    "measure_rollout",
    "parse_bytes",
    "resolve_layout",
    "resolve_shape",
    "run_plan",
]

GiB = 1 << 30


class PlanError(ValueError):
    """The plan cannot be made (no model shape, bad size); the message names the input and the fix."""


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only (Qwen2/Llama-style) model that memory depends on."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    dtype_bytes: int
    """Bytes per value of the checkpoint's `torch_dtype` (what vLLM serves)."""
    source: str
    """Where the shape came from (a config.json path, a built-in entry with its reference, the tiny model)."""
    qkv_bias: bool = True
    """q, k, v projections carry biases (Qwen2; Llama's `attention_bias` is false)."""

    @property
    def kv_dim(self) -> int:
        """Width of k (and of v): kv heads × head dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v (with biases in Qwen2), o, gate/up/down, two RMSNorms."""
        h, kv, i, q = (
            self.hidden_size,
            self.kv_dim,
            self.intermediate_size,
            self.num_attention_heads * self.head_dim,
        )
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * q + 2 * h * kv + bias + q * h + 3 * h * i + 2 * h

    @property
    def embedding_params(self) -> int:
        """Input embedding (V × h); the LM head is the same tensor when tied."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: embedding, layers, final norm, LM head unless tied."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_hidden_layers * self.layer_params + self.hidden_size + head

    @property
    def largest_params(self) -> int:
        """Elements of the largest single tensor: the embedding V·h (the LM head is as large), or a layer's
        gate/up i·h, q/o h·q."""
        q = self.num_attention_heads * self.head_dim
        return max(self.embedding_params, self.intermediate_size * self.hidden_size, q * self.hidden_size)

    @property
    def num_tensors(self) -> int:
        """Distinct tensors of the state dict: per layer q, k, v (and their biases), o, gate, up, down, two
        norms; the embedding, the final norm and the LM head unless tied."""
        per_layer = 9 + (3 if self.qkv_bias else 0)
        return self.num_hidden_layers * per_layer + 2 + (0 if self.tie_word_embeddings else 1)

    @classmethod
    def from_config_json(cls, path: str | Path, source: str | None = None) -> ModelShape:
        """Read an HF config.json (Qwen2/Llama keys)."""
        p = Path(path)
        try:
            c = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(
                f"{p}: cannot read a model config.json ({e}); pass --model-config <config.json>."
            ) from e
        missing = [
            k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in c
        ]
        if missing:
            raise PlanError(f"{p} lacks {missing}; is it a decoder-only HF config.json?")
        heads = int(c["num_attention_heads"])
        dtype = str(c.get("torch_dtype") or c.get("dtype") or "float32")
        return cls(
            hidden_size=int(c["hidden_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            vocab_size=int(c["vocab_size"]),
            intermediate_size=int(c.get("intermediate_size") or 4 * int(c["hidden_size"])),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            dtype_bytes=_DTYPE_BYTES.get(dtype, 4),
            source=source or str(p),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type", "qwen2") == "qwen2")),
        )


BUILTIN_SHAPES: dict[str, ModelShape] = {
    "Qwen2.5-32B": ModelShape(
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=152064,
        intermediate_size=27648,
        tie_word_embeddings=False,
        dtype_bytes=2,
        source="built-in Qwen2.5-32B (huggingface.co/Qwen/Qwen2.5-32B config.json)",
    ),
    "Qwen2.5-0.5B": ModelShape(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=151936,
        intermediate_size=4864,
        tie_word_embeddings=True,
        dtype_bytes=2,
        source="built-in Qwen2.5-0.5B (huggingface.co/Qwen/Qwen2.5-0.5B config.json)",
    ),
}
"""Shapes of models the shipped configs name, for when the weights are not on this machine."""

CHAR_VOCAB = 100
"""Vocabulary of the embedded character tokenizer (4 specials + 95 printable ASCII + newline)."""


def resolve_shape(cfg: Any, model_config: str | None = None) -> ModelShape:
    """The model shape: `model_config` (a config.json), else the model folder's config.json, else the
    built-in entry whose name the model path ends with, else the tiny model of `model.tiny` when the path
    is empty."""
    if model_config:
        return ModelShape.from_config_json(model_config)
    model = cfg.actor_rollout_ref.model
    path = str(model.path or "")
    if not path:
        t = model.tiny
        return ModelShape(
            hidden_size=int(t.hidden_size),
            num_hidden_layers=int(t.num_hidden_layers),
            num_attention_heads=int(t.num_attention_heads),
            num_key_value_heads=int(t.num_key_value_heads),
            head_dim=int(t.head_dim),
            vocab_size=CHAR_VOCAB,
            intermediate_size=int(t.intermediate_size),
            tie_word_embeddings=bool(t.tie_word_embeddings),
            dtype_bytes=4,
            source="the embedded tiny model (actor_rollout_ref.model.tiny)",
        )
    if (Path(path) / "config.json").is_file():
        return ModelShape.from_config_json(Path(path) / "config.json")
    name = path.rstrip("/").rsplit("/", 1)[-1]
    for key, shape in BUILTIN_SHAPES.items():
        if name.lower() == key.lower():
            return shape
    raise PlanError(
        f"actor_rollout_ref.model.path={path!r} has no config.json here and is not a built-in shape "
        f"({sorted(BUILTIN_SHAPES)}); pass --model-config <its config.json>."
    )


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '141G', '512MiB' or a plain number of bytes -> bytes (GB and G are taken as GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise PlanError(f"--gpu-mem {text!r} is not a size; write e.g. 80GiB or 141GiB.")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


PROCESS_BYTES = {"cpu": 481_932 << 10, "cuda": 3 * GiB}
"""Resident memory of a worker process before it loads a model. cpu: the VmRSS of a Ray actor that has
imported torch, transformers and the dapo workers (one thread); cuda: assumed (Python, torch, the host side
of the CUDA context and its libraries)."""
NCCL_BUFFER_BYTES = 32 * 2 * (4 << 20)
"""Assumed host RAM of one GPU process's NCCL communicator: NCCL's default NCCL_BUFFSIZE (4 MiB, the Simple
protocol's buffer) per channel and ring direction, for the 32 channels NCCL opens at most, pinned on the host
for its network proxy (no GPUDirect RDMA)."""
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
MiB measured on the tests' CPU machine beside the buckets; tests/unit/dapo_core/compute/test_plan.py)."""
SAME_DEVICE_COPIES = 4
"""Copies of every byte on a same-device link: into the bucket, into the shared buffer, out of it, into the
rollout's model (`weight_transport.send_all` / `receive_into`)."""
RAY_NODE_BYTES = 1 * GiB
"""Assumed resident memory of Ray's own processes on a node (raylet, GCS, dashboard, log monitor)."""
DRIVER_BYTES = 1 * GiB
"""Assumed resident memory of the driver on node 0 (`dapo train`: the Prefect flow, its client, the store)."""


FSDP_BYTES = 4
"""Bytes per value of the fsdp2 engine's weights, gradients and activations: it trains in float32 (no mixed
precision)."""


def _opt(obj: Any, dotted: str, default: Any) -> Any:
    """`obj.a.b`, or `default` where the config has no such key or it is null."""
    for part in dotted.split("."):
        if obj is None or not hasattr(obj, part):
            return default
        obj = getattr(obj, part)
    return default if obj is None else obj


@dataclass
class Row:
    """One line of a role's table: a name, its bytes and the formula that gives them."""

    name: str
    bytes: int
    formula: str
    phase: str = ""
    """"" = held throughout; otherwise the pass it belongs to (the role's peak is the largest pass). The
    pass "load" (weights arriving, before anything else is allocated) stands alone."""


def _peak(rows: list[Row]) -> int:
    phases: dict[str, int] = {}
    for r in rows:
        if r.phase:
            phases[r.phase] = phases.get(r.phase, 0) + r.bytes
    held = sum(r.bytes for r in rows if not r.phase)
    load = phases.pop("load", 0)
    return max(held + max(phases.values(), default=0), load)


@dataclass
class RolePlan:
    """The estimate of one role on one GPU (on CPU: one process's resident memory), or of a shared GPU, or
    of a node's host RAM."""

    role: str
    rows: list[Row] = field(default_factory=list)
    knobs: list[str] = field(default_factory=list)
    """Config changes (dotted overrides) that each make this check pass; filled by `advise`."""
    budget: int | None = None
    """The memory this role may use (vLLM: gpu_memory_utilization × GPU), when known."""
    host_rows: list[Row] = field(default_factory=list)
    """Host RAM of one process of this role (GPU runs; on CPU the rows are the host RAM)."""
    procs_per_node: int = 1
    """Processes of this role on a node (ranks, or tensor-parallel workers)."""
    note: str = ""
    """A line printed under the role (what the numbers mean beyond the rows)."""
    beside: list[Row] = field(default_factory=list)
    """Device rows outside `budget` (vLLM on GPU: the push's buffers, which torch allocates beside vLLM's
    reservation); counted on the shared GPU."""

    @property
    def total(self) -> int:
        """Rows held throughout plus the largest pass; a "load" pass alone when it is larger."""
        return _peak(self.rows)

    @property
    def host_total(self) -> int:
        """Peak host RAM of one process of this role."""
        return _peak(self.host_rows)

    def fits(self) -> bool | None:
        """True/False against `budget`, None when no budget is known."""
        return None if self.budget is None else self.total <= self.budget


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


@dataclass
class MemoryPlan:
    """Every role's estimate, the shared GPU (colocated layouts), the host RAM per node, the assumptions."""

    shape: ModelShape
    roles: list[RolePlan]
    gpu_mem: int | None
    assumptions: list[str]
    layout: Layout | None = None
    gpu: RolePlan | None = None
    """The sum on one GPU when roles share it (colocated), checked against the GPU."""
    hosts: list[RolePlan] = field(default_factory=list)
    """Host RAM of each distinct node (node 0 holds the driver)."""
    host_mem: int | None = None
    sync: SyncPlan | None = None
    """The weight push after each update: bytes and estimated seconds."""

    def checks(self) -> list[RolePlan]:
        """Every table with a verdict: roles, the shared GPU, the hosts."""
        return [*self.roles, *([self.gpu] if self.gpu else []), *self.hosts]

    def failures(self) -> list[RolePlan]:
        """Tables that do not fit their budget."""
        return [r for r in self.checks() if r.fits() is False]

    def render(self) -> str:
        """The tables a person can check by hand."""
        s, lay = self.shape, self.layout
        where = "host RAM per process" if lay and lay.device == "cpu" else "per GPU"
        budget = f"{_gib(self.gpu_mem)} per GPU" if self.gpu_mem else "unknown (pass --gpu-mem)"
        out = [
            f"model: {s.source}",
            f"  h={s.hidden_size} layers={s.num_hidden_layers} heads={s.num_attention_heads} "
            f"kv_heads={s.num_key_value_heads} head_dim={s.head_dim} i={s.intermediate_size} "
            f"V={s.vocab_size} tied={s.tie_word_embeddings} -> P={s.num_params:,} parameters",
        ]
        if lay is None or lay.device != "cpu":
            out.append(f"GPU memory: {budget}")
        out.append(f"host RAM: {_gib(self.host_mem) + ' per node' if self.host_mem else 'unknown'}")
        out += [*(f"assume: {a}" for a in self.assumptions), ""]
        for role in self.checks():
            out += _render_role(role, where if role in self.roles else "")
        if self.sync is not None:
            out += self.sync.render()
        return "\n".join(out)


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


def _sync_plan(s: ModelShape, lay: Layout, push: _Push) -> SyncPlan:
    """Bytes and seconds of one push at the assumed bandwidths: the FSDP2 all-gather each rank takes part
    in, then the links (same_device: every rank copies into its replica at once; broadcast: rank 0 sends once
    to every replica)."""
    b, P = push.dtype_bytes, push.params
    sp = SyncPlan(push.kind, push.links, push.receivers, b, push.bucket, push.per_link)
    gpu, multi = lay.device == "cuda", lay.nnodes > 1
    intra = (
        (NVLINK_BYTES_PER_S, "NVLINK_BYTES_PER_S") if gpu else (LOOPBACK_BYTES_PER_S, "LOOPBACK_BYTES_PER_S")
    )
    link = (NETWORK_BYTES_PER_S, "NETWORK_BYTES_PER_S") if multi else intra
    if lay.strategy in FSDP_STRATEGIES and lay.dp > 1:
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


def _render_role(role: RolePlan, where: str) -> list[str]:
    width = max((len(r.name) + len(r.phase) + 2 for r in [*role.rows, *role.beside]), default=10)
    out = [f"[{role.role}]" + (f" ({where})" if where else "")]
    for r in role.rows:
        name = f"{r.phase}: {r.name}" if r.phase else r.name
        out.append(f"  {name:<{width}} {_gib(r.bytes):>11}   = {r.formula}")
    verdict = {None: "", True: "  fits", False: "  DOES NOT FIT"}[role.fits()]
    budget = f" of {_gib(role.budget)}" if role.budget is not None else ""
    how = " (held throughout + the largest pass)" if any(r.phase for r in role.rows) else ""
    out.append(f"  {'total':<{width}} {_gib(role.total):>11}{budget}{verdict}{how}")
    if role.beside:
        out.append("  beside its reservation, on the same GPU:")
        for r in role.beside:
            name = f"{r.phase}: {r.name}" if r.phase else r.name
            out.append(f"    {name:<{width - 2}} {_gib(r.bytes):>11}   = {r.formula}")
    if role.host_rows:
        out.append(f"  host RAM of each of its {role.procs_per_node} process(es) on a node:")
        for r in role.host_rows:
            name = f"{r.phase}: {r.name}" if r.phase else r.name
            out.append(f"    {name:<{width - 2}} {_gib(r.bytes):>11}   = {r.formula}")
        out.append(f"    {'peak':<{width - 2}} {_gib(role.host_total):>11}")
    if role.note:
        out.append(f"  note: {role.note}")
    if role.fits() is False:
        out.append(
            "  turn: " + ("; or ".join(role.knobs) if role.knobs else "no single setting fits (see below)")
        )
    out.append("")
    return out


def _largest(role: RolePlan, k: int = 3) -> str:
    """The `k` largest rows of a table, for saying what does not fit."""
    rows = sorted(role.rows, key=lambda r: -r.bytes)[:k]
    return "largest: " + ", ".join(
        f"{(r.phase + ': ') if r.phase else ''}{r.name} {_gib(r.bytes)}" for r in rows
    )


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"


def activation_values_per_token_layer(s: ModelShape) -> int:
    """Values autograd keeps per token and decoder layer without checkpointing: 8h + 4·kv + 4i."""
    return 8 * s.hidden_size + 4 * s.kv_dim + 4 * s.intermediate_size


def activation_bytes(
    s: ModelShape,
    tokens: int,
    act_bytes: int,
    checkpointing: bool,
    attn_sq_tokens: int = 0,
) -> tuple[int, str]:
    """Bytes of a micro-batch's activations at the update's peak (and the formula).

    Without checkpointing: every layer's saved tensors (norm inputs/outputs, q, k, v, rotary q/k, attention
    output, MLP gate, up, activation and product), `N·layers·(8h+4kv+4i)`. With checkpointing: each layer's
    input (`N·layers·h`) plus, in backward, one layer recomputed and its gradient working set
    (`2·N·(8h+4kv+4i)`). `attn_sq_tokens` = Σ T² of the attention blocks when the kernel builds one layer's
    (heads, T, T) scores at a time (CPU SDPA); 0 on CUDA's fused kernels.
    """
    per = activation_values_per_token_layer(s)
    L, h = s.num_hidden_layers, s.hidden_size
    scores = s.num_attention_heads * attn_sq_tokens
    if checkpointing:
        n = tokens * (L * h + 2 * per) + scores
        f = f"N·(layers·h + 2·(8h+4kv+4i))·b = {tokens}·({L}·{h} + 2·{per})·{act_bytes}"
    else:
        n = tokens * L * per + scores
        f = f"N·layers·(8h+4kv+4i)·b = {tokens}·{L}·{per}·{act_bytes}"
    if attn_sq_tokens:
        f += f" + heads·ΣT²·b (one layer's scores, ΣT²={attn_sq_tokens:,})"
    return n * act_bytes, f


def _micro_tokens(
    *, dynamic: bool, budget: int, micro_rows: int, width: int, packed: bool
) -> tuple[int, int, str]:
    """(tokens N of the largest micro-batch on one GPU, Σ T² of its attention blocks, how N was chosen). No
    engine here has sequence parallelism (verl's Ulysses), so a micro-batch's tokens are on one GPU. Packed
    rows attend per row (`varlen_attention`): rows of at most `width` tokens summing to N give Σ T² ≤ N·width,
    and no N×N mask exists."""
    if dynamic and packed:
        n = max(budget, width)
        sq, how = n * width, f"token budget {budget} (packed; a longer row goes alone, width {width})"
    elif dynamic:
        rows = max(1, budget // width)
        n, sq, how = (
            rows * width,
            rows * width * width,
            f"{rows} row(s) × padded width {width} within budget {budget}",
        )
    elif packed:
        n = micro_rows * width
        sq, how = n * width, f"{micro_rows} rows × width {width}, packed"
    else:
        n = micro_rows * width
        sq, how = micro_rows * width * width, f"{micro_rows} rows × padded width {width}"
    return n, sq, how


def _logits_row(
    s: ModelShape,
    tokens: int,
    model_bytes: int,
    *,
    entropy: bool,
    packed: bool,
    phase: str = "",
    grad: bool = True,
) -> Row:
    """The LM head's output and the float32 copies the log-prob (and entropy) code makes of it.

    Padded: (N, V) logits in the model dtype plus k float32 (N, V) tensors (fp32 copy, log-softmax, softmax
    and product for the entropy, one gradient). Packed (`use_remove_padding`): the LM head runs on response
    positions only (≤ N), its gradient is one more such tensor, and the float32 work is done in checkpointed
    chunks of `LOGIT_CHUNK_TOKENS` positions.
    """
    from dapo_core.compute.engines.train import LOGIT_CHUNK_TOKENS

    k = 2 + (2 if entropy else 0) + (1 if grad else 0)
    parts = (
        ["fp32 copy", "log-softmax"]
        + (["softmax", "product"] if entropy else [])
        + (["grad"] if grad else [])
    )
    V = s.vocab_size
    if packed:
        chunk = min(tokens, LOGIT_CHUNK_TOKENS)
        held = 2 if grad else 1
        return Row(
            "logits",
            tokens * V * model_bytes * held + chunk * V * 4 * k,
            f"N·V·b·{held} + chunk·V·4·{k} = {tokens}·{V}·{model_bytes}·{held} + {chunk}·{V}·{4 * k} "
            f"(response-position logits{', their grad' if grad else ''}; one chunk of {', '.join(parts)})",
            phase,
        )
    block = _logit_block(tokens * V)
    if block < tokens * V:  # blocked float32 work: the logits (and their grad) plus one block's temporaries
        held = 2 if grad else 1
        return Row(
            "logits",
            tokens * V * model_bytes * held + block * 4 * k,
            f"N·V·b·{held} + block·4·{k} = {tokens}·{V}·{model_bytes}·{held} + {block:,}·{4 * k} (logits"
            f"{', their grad' if grad else ''}; one block of {', '.join(parts)})",
            phase,
        )
    return Row(
        "logits",
        tokens * V * (model_bytes + 4 * k),
        f"N·V·(b + 4·{k}) = {tokens}·{V}·({model_bytes} + {4 * k}) ({', '.join(parts)})",
        phase,
    )


def _slice_grad_row(s: ModelShape, tokens: int, model_bytes: int, *, packed: bool, phase: str) -> Row | None:
    """The backward of log-probs computed in chunks (packed) or blocks (padded, above `CHUNK_ELEMENTS`):
    each chunk is a slice of the logits, and a slice's backward returns a gradient of the full (N, V) shape,
    added into the logits' gradient: one more full-size tensor beside it (measured on CPU: the peak is
    three N·V tensors plus one chunk's temporaries). None where the float32 work is done at once."""
    V = s.vocab_size
    if not packed and _logit_block(tokens * V) >= tokens * V:
        return None
    return Row(
        "logits grad of a slice",
        tokens * V * model_bytes,
        f"N·V·b = {tokens}·{V}·{model_bytes} (a chunk's gradient at the full logits' size, from its slice's "
        "backward)",
        phase,
    )


def _logit_block(values: int) -> int:
    """Logits whose float32 temporaries the padded log-prob code holds at once: all of them, or one block of
    `dapo_core.compute.logits.CHUNK_ELEMENTS` where the code computes in blocks."""
    try:
        from dapo_core.compute.logits import CHUNK_ELEMENTS  # type: ignore[import-not-found, unused-ignore]
    except ImportError:  # no blocked log-prob code: the whole tensor at once
        return values
    return min(values, int(CHUNK_ELEMENTS))


def _no_grad_row(s: ModelShape, tokens: int, b: int, attn_sq: int, how: str, phase: str) -> Row:
    """A forward without gradients keeps one layer's tensors alive at a time: N·(4h + 2i)·b (+ scores)."""
    n = tokens * (4 * s.hidden_size + 2 * s.intermediate_size) + s.num_attention_heads * attn_sq
    return Row(
        "activations (no grad)", n * b, f"N·(4h + 2i)·b + heads·ΣT²·b, one layer live; N: {how}", phase
    )


_DTYPE_NAMES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class _States:
    """Weights, gradients and optimizer of one rank of a trained (or frozen) model, device and host rows."""

    dev: list[Row] = field(default_factory=list)
    host: list[Row] = field(default_factory=list)
    compute_bytes: int = 4
    """Bytes per element of the passes' activations and logits (2 under bf16 mixed precision)."""
    weight_bytes: int = 4
    """Bytes per element of the weights as stored (what a weight sync copies)."""
    gathered: int = 0
    """Bytes of the full layers FSDP gathers around the running one (added to every pass)."""
    autocast: int = 0
    """Bytes of the bf16 weight copies autocast keeps through a pass (torch engine, mixed precision)."""


def _mixed_bf16(section: Any) -> bool:
    """Whether an actor section trains in bf16 mixed precision (`fsdp_config.mixed_precision.param_dtype`)."""
    from dapo_core.config.checks import train_dtype

    fsdp_config = getattr(section, "fsdp_config", None)
    if fsdp_config is None:
        return False
    return train_dtype(str(fsdp_config.mixed_precision.param_dtype)) == "bfloat16"


def _train_states(
    s: ModelShape, lay: Layout, section: Any, *, params: int, trained: bool, dtype_bytes: int = 4
) -> _States:
    """Rows of the weights, gradients and AdamW state of one rank under `lay.strategy` (and where they live).

    torch: everything float32 on the device (`dtype_bytes` for a frozen model). DeepSpeed: ZeRO stage s
    shards optimizer (s ≥ 1), gradients (s ≥ 2) and weights (s = 3) over `lay.dp`; `offload_*` move them to
    the host. FSDP2: float32 shards of weights, gradients and AdamW m, v over dp, each decoder layer gathered
    in full while it runs (with the next one prefetched), float32 compute. Under bf16 mixed precision
    (`fsdp_config.mixed_precision.param_dtype`) the passes compute in 2 bytes: FSDP2 gathers bf16 layers,
    the torch engine's autocast holds a bf16 copy of every weight through a pass.
    """
    P, big, st = params, s.embedding_params, _States()
    ds = section is not None and lay.strategy == "deepspeed" and hasattr(section, "deepspeed")
    fsdp = lay.strategy in FSDP_STRATEGIES and section is not None
    mixed = trained and _mixed_bf16(section) and not ds
    if fsdp:
        dp = lay.dp
        wb = FSDP_BYTES if trained else dtype_bytes
        st.compute_bytes = st.weight_bytes = wb
        gb = 2 if mixed else wb  # MixedPrecisionPolicy gathers bf16 copies of the shards
        if mixed:
            st.compute_bytes = 2
        st.dev.append(
            Row("load", big * wb // dp, f"meta device, then its rows of one tensor: V·h·{wb} B / dp", "load")
        )
        st.dev.append(Row("weights", P * wb // dp, f"P·{wb} B / dp {dp}"))
        if trained:
            st.dev.append(Row("gradients", P * 4 // dp, f"P·4 B / dp {dp}"))
            st.dev.append(Row("optimizer", P * 8 // dp, f"P·8 B (AdamW m + v) / dp {dp}"))
        head = 0 if s.tie_word_embeddings else big
        st.gathered = (2 * s.layer_params + big + head) * gb + (s.layer_params * 4 if trained else 0)
        return st
    if ds and trained:
        d = section.deepspeed
        stage, dp = int(d.zero_stage), lay.dp
        wb, opt_b = (2, 12) if d.bf16 else (4, 8)
        st.compute_bytes = st.weight_bytes = wb
        st.host.append(Row("load", P * 4, "P·4 B: the float32 model is read into host RAM", "load"))
        st.dev.append(
            Row(
                "load",
                P * wb,
                f"P·{wb} B: DeepSpeed moves the whole module to the GPU (no zero.Init)",
                "load",
            )
        )
        if stage == 3 and d.offload_param:
            work = 2 * s.layer_params + big
            st.dev.append(Row("weights", work * wb, f"offload_param: (2 layers + embedding)·{wb} B gathered"))
            st.host.append(Row("weights", P * wb // dp, f"P·{wb} B / dp {dp} (offload_param)"))
        else:
            div = dp if stage == 3 else 1
            st.dev.append(Row("weights", P * wb // div, f"P·{wb} B" + (f" / dp {dp}" if div > 1 else "")))
        gdiv = dp if stage >= 2 else 1
        if d.offload_optimizer:
            st.host.append(
                Row(
                    "optimizer",
                    P * 16 // dp,
                    f"P·16 B / dp {dp} (fp32 master, m, v, fp32 gradients; CPU Adam)",
                )
            )
            if stage < 2:
                st.dev.append(Row("gradients", P * wb, f"P·{wb} B"))
        else:
            st.dev.append(Row("gradients", P * wb // gdiv, f"P·{wb} B" + (f" / dp {dp}" if gdiv > 1 else "")))
            odiv = dp if stage >= 1 else 1
            what = "fp32 master + m + v" if opt_b == 12 else "AdamW m + v"
            st.dev.append(
                Row(
                    "optimizer",
                    P * opt_b // odiv,
                    f"P·{opt_b} B ({what})" + (f" / dp {dp}" if odiv > 1 else ""),
                )
            )
        if stage == 3:
            st.dev.append(
                Row("gathered weights", P * wb, f"P·{wb} B: ZeRO-3 gathers every weight for a push", "sync")
            )
        return st
    wb = 4 if trained else dtype_bytes
    st.compute_bytes = st.weight_bytes = wb
    if mixed:
        st.compute_bytes, st.autocast = 2, P * 2
    if lay.device == "cuda":
        st.host.append(Row("load", P * wb, f"P·{wb} B: read into host RAM, then moved", "load"))
    st.dev.append(Row("weights", P * wb, f"P·{wb} B" + ("" if trained else " (forward only)")))
    if trained:
        st.dev.append(Row("gradients", P * 4, "P·4 B"))
        st.dev.append(Row("optimizer", P * 8, "P·8 B (AdamW m + v)"))
    return st


def _place(role: RolePlan, st: _States, lay: Layout) -> None:
    """Device rows to the role, host rows to its host table (on CPU both are the process's memory)."""
    what = "measured on CPU" if lay.device == "cpu" else "with the CUDA context's host side, assumed"
    base = Row("process", PROCESS_BYTES[lay.device], f"Python, torch, transformers ({what})")
    if lay.device == "cpu":
        role.rows[:0] = [base, *[r for r in st.dev if r.phase != "load"], *st.host]
    else:
        role.rows[:0] = st.dev
        role.host_rows[:0] = [base, _nccl_row(), *st.host]


def _nccl_row() -> Row:
    return Row(
        "NCCL buffers", NCCL_BUFFER_BYTES, "32 channels × 2 directions × NCCL_BUFFSIZE 4 MiB (assumed)"
    )


def make_plan(
    cfg: Any,
    *,
    gpu_mem: int | None = None,
    model_config: str | None = None,
    dp: int = 1,
    device: str | None = None,
    host_mem: int | None = None,
) -> MemoryPlan:
    """The estimate of every role of the resolved config `cfg` (a DapoConfig): per GPU (per process on CPU)
    and per node's host RAM. `dp` is the what-if ZeRO world of the one-process engines (torch, DeepSpeed)."""
    from dapo_core.config.loading import need_reference_policy, use_critic

    if dp < 1:
        raise PlanError(f"--dp {dp} must be >= 1.")
    s = resolve_shape(cfg, model_config)
    lay = resolve_layout(cfg, dp=dp, device=device)
    if lay.colocated and lay.world % lay.tp:
        raise PlanError(
            f"trainer.nnodes × n_gpus_per_node = {lay.world} GPUs is not a multiple of "
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={lay.tp}; set a tp that divides it."
        )
    arr = cfg.actor_rollout_ref
    width = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    assumptions = [_layout_line(lay), f"sequence width T = max_prompt_length + max_response_length = {width}"]
    if lay.device == "cuda":
        assumptions.append("attention scores not kept (CUDA fused kernels)")
    else:
        assumptions.append("CPU: each role is one process; its rows are that process's resident memory")
    ckpt, packed = bool(arr.model.enable_gradient_checkpointing), bool(arr.model.use_remove_padding)
    roles = [_actor_plan(cfg, s, lay, width, ckpt, packed, gpu_mem)]
    if need_reference_policy(cfg):
        roles.append(_ref_plan(cfg, s, lay, width, packed, gpu_mem))
    if use_critic(cfg):
        roles.append(_critic_plan(cfg, s, lay, width, ckpt, gpu_mem))
    roles.append(_rollout_plan(cfg, s, lay, gpu_mem, width, assumptions))
    plan = MemoryPlan(
        shape=s, roles=roles, gpu_mem=gpu_mem, assumptions=assumptions, layout=lay, host_mem=host_mem
    )
    if lay.colocated and lay.device == "cuda":
        plan.gpu = _shared_gpu(cfg, roles, gpu_mem)
        for r in roles:
            if r.role != "rollout":
                r.budget = None  # checked together on the shared GPU
    plan.hosts = _host_plans(cfg, s, lay, roles, host_mem)
    plan.sync = _sync_plan(s, lay, _push(cfg, s, lay))
    return plan


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


def _pass_rows(
    role: RolePlan,
    s: ModelShape,
    cb: int,
    *,
    phase: str,
    dynamic: bool,
    budget: int,
    micro_rows: int,
    width: int,
    packed: bool,
    scores: bool,
    ckpt: bool | None,
    entropy: bool,
    shared: tuple[int, int, bool] | None = None,
) -> None:
    """Activation and logits rows of one pass; `ckpt` None = a forward without gradients. `shared`
    (`_shared_shape`): the forwards run each prompt of a micro-batch once (`use_shared_prompt`); under a
    token budget the micro-batches' rows are not known here, so the pass is planned without sharing (an
    upper bound)."""
    if shared is not None and micro_rows > 1 and not dynamic and not ckpt:
        # the engine shares prompts only without gradient checkpointing (HF drops the cache under it)
        _shared_pass_rows(
            role,
            s,
            cb,
            phase=phase,
            micro_rows=micro_rows,
            width=width,
            shared=shared,
            scores=scores,
            grad=ckpt is not None,
            entropy=entropy,
        )
        return
    n, sq, how = _micro_tokens(
        dynamic=dynamic, budget=budget, micro_rows=micro_rows, width=width, packed=packed
    )
    if ckpt is None:
        role.rows.append(_no_grad_row(s, n, cb, sq if scores else 0, how, phase))
    else:
        act, f = activation_bytes(s, n, cb, ckpt, sq if scores else 0)
        role.rows.append(Row("activations" + (" (ckpt)" if ckpt else ""), act, f"{f}; N: {how}", phase))
    role.rows.append(
        _logits_row(s, n, cb, entropy=entropy, packed=packed, phase=phase, grad=ckpt is not None)
    )
    extra = _slice_grad_row(s, n, cb, packed=packed, phase=phase) if ckpt is not None else None
    if extra is not None:
        role.rows.append(extra)


def _shared_shape(cfg: Any, lay: Layout, role: str) -> tuple[int, int, bool] | None:
    """(n, max prompt length, shuffled mini-batches) when `role`'s forwards share prompts
    (`use_shared_prompt`), else None: the fsdp2 actor never shares, a sharded reference neither."""
    arr = cfg.actor_rollout_ref
    if not bool(arr.model.use_shared_prompt) or int(arr.rollout.n) < 2:
        return None
    if lay.strategy in FSDP_STRATEGIES and (role == "actor" or lay.dp > 1):
        return None
    actor = arr.actor
    several_minis = int(actor.ppo_mini_batch_size) < int(cfg.data.train_batch_size)
    shuffled = role == "actor" and bool(actor.shuffle) and several_minis
    return int(arr.rollout.n), int(cfg.data.max_prompt_length), shuffled


def _prompts_per_micro(micro_rows: int, n: int, shuffled: bool) -> int:
    """The most distinct prompts a micro-batch of `micro_rows` can hold: the rows of a (mini-)batch come
    grouped by prompt (`grouped_order`), so ⌈(rows − 1) / n⌉ + 1 (⌈rows / n⌉ when n divides rows); shuffled
    mini-batches split groups, so up to one prompt per row."""
    if shuffled:
        return micro_rows
    return micro_rows // n if micro_rows % n == 0 else -(-(micro_rows - 1) // n) + 1


def _shared_pass_rows(
    role: RolePlan,
    s: ModelShape,
    cb: int,
    *,
    phase: str,
    micro_rows: int,
    width: int,
    shared: tuple[int, int, bool],
    scores: bool,
    grad: bool,
    entropy: bool,
) -> None:
    """Rows of a shared-prompt pass (`TrainEngine.log_probs` with `share_prompt`) at the plan's width, where
    every response is R long: there the grouped layout saves nothing (`microbatch.group_rows` declines), so
    the engine runs the G distinct prompts once with a KV cache (G·P positions), copies the cache to each of
    the rows, and runs the rows' responses on it (rows·R positions; scores rows·R·(P + R) per head). The
    copied cache (rows·(P + R) keys and values per layer) is held through the pass, and kept for the backward
    when there is one; the LM head runs on rows·R + G positions."""
    n, P, shuffled = shared
    R = width - P
    G = _prompts_per_micro(micro_rows, n, shuffled)
    tokens = G * P + micro_rows * R
    sq = G * P * P + micro_rows * R * width
    how = f"{G} prompt(s) × P {P} + {micro_rows} responses × R {R} (shared prompt, KV cache)"
    if grad:
        act, f = activation_bytes(s, tokens, cb, False, sq if scores else 0)
        role.rows.append(Row("activations", act, f"{f}; N: {how}", phase))
    else:
        role.rows.append(_no_grad_row(s, tokens, cb, sq if scores else 0, how, phase))
    kv = micro_rows * width * s.num_hidden_layers * 2 * s.num_key_value_heads * s.head_dim * cb
    role.rows.append(
        Row(
            "shared-prompt kv cache",
            kv,
            f"rows·T·layers·2·kv·head_dim·b = {micro_rows}·{width}·{s.num_hidden_layers}·2·"
            f"{s.num_key_value_heads}·{s.head_dim}·{cb} (the prompts' cache copied to every row)",
            phase,
        )
    )
    logit_tokens = micro_rows * R + G
    row = _logits_row(s, logit_tokens, cb, entropy=entropy, packed=False, phase=phase, grad=grad)
    row.formula += f"; N = rows·R + G = {logit_tokens} (response positions and each prompt's last)"
    role.rows.append(row)
    extra = _slice_grad_row(s, logit_tokens, cb, packed=False, phase=phase) if grad else None
    if extra is not None:
        role.rows.append(extra)


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


def _sender_rows(role: RolePlan, s: ModelShape, lay: Layout, push: _Push, weight_bytes: int) -> None:
    """The push's pass on an actor rank that sends (rank 0 of a broadcast; every rank of same_device links):
    the tensor in flight (FSDP2: its shard cast to the push dtype and all-gathered; one-process engines: a
    cast copy when the weights are not in the push dtype) and the bucket(s). On GPU they are device memory,
    on CPU the process's."""
    b, gpu = push.dtype_bytes, lay.device == "cuda"
    if not gpu:
        role.rows.append(_link_row())
    if lay.strategy in FSDP_STRATEGIES:
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


def _actor_plan(
    cfg: Any, s: ModelShape, lay: Layout, width: int, ckpt: bool, packed: bool, gpu_mem: int | None
) -> RolePlan:
    arr = cfg.actor_rollout_ref
    actor, ro = arr.actor, arr.rollout
    n = int(ro.n)
    a = RolePlan("actor", budget=gpu_mem, procs_per_node=lay.per_node if lay.colocated else 1)
    st = _train_states(s, lay, actor, params=s.num_params, trained=True)
    _place(a, st, lay)
    scores = lay.device == "cpu"
    mini_rows = int(actor.ppo_mini_batch_size) * n
    data_dp = lay.dp if lay.colocated else 1
    common = {"width": width, "packed": packed, "scores": scores, "shared": _shared_shape(cfg, lay, "actor")}
    _pass_rows(
        a,
        s,
        st.compute_bytes,
        phase="update",
        dynamic=bool(actor.use_dynamic_bsz),
        budget=int(actor.ppo_max_token_len_per_gpu),
        micro_rows=max(1, int(actor.ppo_micro_batch_size_per_gpu or -(-mini_rows // data_dp))),
        ckpt=ckpt,
        entropy=True,
        **common,  # type: ignore[arg-type]
    )
    gen_rows = int(cfg.data.train_batch_size) * n
    _pass_rows(
        a,
        s,
        st.compute_bytes,
        phase="log-prob",
        dynamic=bool(ro.log_prob_use_dynamic_bsz),
        budget=int(ro.log_prob_max_token_len_per_gpu),
        micro_rows=max(1, int(ro.log_prob_micro_batch_size_per_gpu or -(-gen_rows // data_dp))),
        ckpt=None,
        entropy=True,
        **common,  # type: ignore[arg-type]
    )
    per_pass = [
        ("gathered layers", st.gathered, "FSDP: (2 layers + embedding + head)·b + 1 layer's grads"),
        ("autocast copies", st.autocast, "P·2 B: autocast's bf16 casts of the weights, per pass"),
    ]
    for name, nbytes, formula in per_pass:
        if nbytes:
            a.rows.extend(Row(name, nbytes, formula, phase) for phase in ("update", "log-prob"))
    _sender_rows(a, s, lay, _push(cfg, s, lay), st.weight_bytes)
    return a


def _ref_plan(
    cfg: Any, s: ModelShape, lay: Layout, width: int, packed: bool, gpu_mem: int | None
) -> RolePlan:
    arr = cfg.actor_rollout_ref
    ref = arr.ref
    rb = _DTYPE_NAMES.get(str(_opt(ref, "dtype", "float32")), 4)
    r = RolePlan("ref", budget=gpu_mem, procs_per_node=lay.per_node if lay.colocated else 1)
    section = ref if lay.strategy in FSDP_STRATEGIES else None
    st = _train_states(s, lay, section, params=s.num_params, trained=False, dtype_bytes=rb)
    if lay.strategy not in FSDP_STRATEGIES:
        st.dev[0].formula += " (actor_rollout_ref.ref.dtype)"
    cb = rb if lay.strategy not in FSDP_STRATEGIES else st.compute_bytes
    _place(r, st, lay)
    gen_rows = int(cfg.data.train_batch_size) * int(arr.rollout.n)
    data_dp = lay.dp if lay.colocated else 1
    _pass_rows(
        r,
        s,
        cb,
        phase="log-prob",
        dynamic=bool(ref.log_prob_use_dynamic_bsz),
        budget=int(ref.log_prob_max_token_len_per_gpu),
        micro_rows=max(1, int(ref.log_prob_micro_batch_size_per_gpu or -(-gen_rows // data_dp))),
        width=width,
        packed=packed,
        scores=lay.device == "cpu",
        ckpt=None,
        entropy=False,
        shared=_shared_shape(cfg, lay, "ref"),
    )
    if st.gathered:
        r.rows.append(
            Row("gathered layers", st.gathered, "FSDP: (2 layers + embedding + head)·b", "log-prob")
        )
    return r


def _critic_plan(
    cfg: Any, s: ModelShape, lay: Layout, width: int, ckpt: bool, gpu_mem: int | None
) -> RolePlan:
    arr, crit = cfg.actor_rollout_ref, cfg.critic
    actor = arr.actor
    c = RolePlan("critic", budget=gpu_mem, procs_per_node=lay.per_node if lay.colocated else 1)
    cp = s.num_params - (0 if s.tie_word_embeddings else s.embedding_params)  # no LM head; + value head
    torch_lay = Layout(lay.device, lay.nnodes, lay.per_node, "torch", 1, lay.tp, lay.replicas, lay.colocated)
    st = _train_states(s, torch_lay, None, params=cp, trained=True)
    st.dev[0].formula = f"P_backbone·4 B = {cp:,}·4 (torch engine, float32)"
    _place(c, st, lay)
    cckpt = (
        ckpt
        if crit.model.enable_gradient_checkpointing is None
        else bool(crit.model.enable_gradient_checkpointing)
    )
    cpacked = bool(crit.model.use_remove_padding)
    cdyn = bool(actor.use_dynamic_bsz if crit.use_dynamic_bsz is None else crit.use_dynamic_bsz)
    cbudget = int(crit.ppo_max_token_len_per_gpu)
    mini_rows = int(actor.ppo_mini_batch_size) * int(arr.rollout.n)
    scores = lay.device == "cpu"
    n, sq, how = _micro_tokens(
        dynamic=cdyn,
        budget=cbudget,
        micro_rows=int(crit.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu or mini_rows),
        width=width,
        packed=cpacked,
    )
    act, f = activation_bytes(s, n, 4, cckpt, sq if scores else 0)
    c.rows.append(Row("activations" + (" (ckpt)" if cckpt else ""), act, f"{f}; N: {how}", "update"))
    c.rows.append(Row("values", n * s.hidden_size * 4, "N·h·4 B (value head input)", "update"))
    vt, vsq, vhow = _micro_tokens(
        dynamic=cdyn,
        budget=int(crit.forward_max_token_len_per_gpu or cbudget),
        micro_rows=int(cfg.data.train_batch_size) * int(arr.rollout.n),
        width=width,
        packed=cpacked,
    )
    c.rows.append(_no_grad_row(s, vt, 4, vsq if scores else 0, vhow, "values"))
    return c


def _rollout_plan(
    cfg: Any, s: ModelShape, lay: Layout, gpu_mem: int | None, width: int, assumptions: list[str]
) -> RolePlan:
    """vLLM: what it needs (weights / tp, the profiled forward, the KV cache of the batch's concurrent
    sequences) against what it reserves (gpu_memory_utilization × GPU); HF: weights, KV cache, prefill and
    sampling tensors of one batch of `max_num_seqs` rows."""
    ro = cfg.actor_rollout_ref.rollout
    n = int(ro.n)
    R, Pl = int(cfg.data.max_response_length), int(cfg.data.max_prompt_length)
    rows_all = int(cfg.data.gen_batch_size or cfg.data.train_batch_size) * n
    V, L = s.vocab_size, s.num_hidden_layers
    dtype = str(ro.dtype)
    if ro.name == "vllm":
        tp = lay.tp
        db = _DTYPE_NAMES.get(dtype, 2 if lay.device == "cuda" else 4)
        kv_heads = -(-s.num_key_value_heads // tp)
        per_tok = 2 * L * kv_heads * s.head_dim * db
        r = RolePlan("rollout", procs_per_node=lay.per_node)  # every device holds one TP rank
        r.rows.append(Row("weights", s.num_params * db // tp, f"P·{db} B / tp {tp}"))
        tokens, seqs = int(ro.max_num_batched_tokens), int(ro.max_num_seqs)
        work = tokens * (4 * s.hidden_size + 2 * s.intermediate_size // tp) * db + seqs * V * 4 * 2
        r.rows.append(
            Row(
                "profiled forward",
                work,
                f"max_num_batched_tokens·(4h + 2i/tp)·b + max_num_seqs·V·4·2 = {tokens}·(4·{s.hidden_size} + "
                f"2·{s.intermediate_size}/{tp})·{db} + {seqs}·{V}·8",
            )
        )
        rows = -(-rows_all // lay.replicas)
        conc = min(rows, seqs)
        need = conc * width * per_tok
        kvf = f"2·layers·ceil(kv_heads/tp)·head_dim·b = 2·{L}·{kv_heads}·{s.head_dim}·{db} B per token"
        if lay.device == "cpu":
            from dapo_core.compute.engines.vllm_rollout import CPU_KV_CACHE_BYTES

            r.rows.append(Row("kv cache", CPU_KV_CACHE_BYTES, "kv_cache_memory_bytes (vLLM-CPU, fixed)"))
        elif gpu_mem is None:
            r.rows.append(Row("kv cache", need, f"{conc} concurrent sequences × T {width} × {kvf}"))
        else:
            r.budget = int(float(ro.gpu_memory_utilization) * gpu_mem)
            room = r.budget - r.rows[0].bytes - work
            one = width * per_tok
            held = max(one, min(need, room))
            r.rows.append(
                Row(
                    "kv cache",
                    held,
                    f"min(batch, room): the batch's {conc} concurrent sequences need {_gib(need)}; "
                    f"util·GPU − weights − forward leaves {_gib(max(room, 0))} ({max(room, 0) // one} full "
                    f"sequences; at least 1 is needed); {kvf}",
                )
            )
            r.note = (
                f"vLLM reserves gpu_memory_utilization × GPU = {_gib(r.budget)} on each of its GPUs whatever "
                "it needs; the rest of its cache goes unused"
                if need < room
                else f"vLLM reserves {_gib(r.budget)} per GPU; sequences beyond "
                f"{max(room, 0) // one} wait for room (slower, not an error)"
            )
        push = _push(cfg, s, lay)
        _receiver_rows(r, lay, push, vllm=True)
        if lay.device == "cuda":
            r.beside = [row for row in r.rows if row.phase == "sync"]
            r.rows = [row for row in r.rows if row.phase != "sync"]
        process = Row(
            "process",
            PROCESS_BYTES[lay.device],
            "vLLM worker: Python, torch, CUDA context's host side (assumed)",
        )
        if lay.device == "cpu":
            r.rows.insert(0, process)
            return r
        r.host_rows = [
            process,
            _nccl_row(),
            Row(
                "weight group",
                max(push.fill, push.largest),
                "max(bucket's fill, largest tensor): the group pickled through host memory to the workers "
                "(collective_rpc, assumed)",
                "sync",
            ),
        ]
        return r
    db = _DTYPE_NAMES.get(dtype, 4)
    rows = min(-(-rows_all // lay.replicas), int(ro.max_num_seqs))  # one replica's share
    prompts = -(-rows // n)
    per_tok = 2 * L * s.kv_dim * db
    r = RolePlan("rollout", budget=gpu_mem, procs_per_node=lay.per_node)  # one replica per device
    r.rows.append(Row("weights", s.num_params * db, f"P·{db} B (HF engine, rollout.dtype {dtype})"))
    r.rows.append(
        Row(
            "kv cache",
            (prompts * Pl + rows * R) * per_tok,
            f"(prompts·P + rows·R)·2·layers·kv·b = ({prompts}·{Pl} + {rows}·{R})·2·{L}·{s.kv_dim}·{db} "
            f"(rows = min(gen batch × n / replicas, max_num_seqs); a prompt's cache kept once)",
        )
    )
    scores = s.num_attention_heads * prompts * Pl * Pl if lay.device == "cpu" else 0
    # On CPU the allocator keeps the prefill's blocks through the decode steps (glibc returns little of
    # them), so the two add up: one pass. On GPU the prefill's tensors are free before the decode's.
    cpu = lay.device == "cpu"
    r.rows.append(
        Row(
            "logits + one layer",
            prompts * (V + Pl * (4 * s.hidden_size + 2 * s.intermediate_size)) * db + scores * db,
            "prompts·(V + P·(4h + 2i))·b (+ CPU scores heads·prompts·P²·b): the last position's logits and "
            "one layer",
            "generate" if cpu else "prefill",
        )
    )
    block = max(1, min(R, (1 << 20) // V))
    r.rows.append(
        Row(
            "sampling",
            rows * V * 4 * (6 + block),
            f"rows·V·4·(6 + block) = {rows}·{V}·4·(6 + {block}) (logits, scaled, log-softmax, filtered, "
            f"softmax, ratio; exponential variates for {block} steps)",
            "generate" if cpu else "decode",
        )
    )
    _receiver_rows(r, lay, _push(cfg, s, lay), vllm=False)
    if cpu:
        r.rows.insert(0, Row("process", PROCESS_BYTES["cpu"], "Python, torch, transformers (measured)"))
    else:
        r.host_rows = [
            Row("process", PROCESS_BYTES["cuda"], "Python, torch, CUDA context's host side (assumed)"),
            _nccl_row(),
            Row("load", s.num_params * db, f"P·{db} B read into host RAM, then moved", "load"),
        ]
    return r


def _shared_gpu(cfg: Any, roles: list[RolePlan], gpu_mem: int | None) -> RolePlan:
    """The sum on one GPU of a colocated layout: every role's held rows, plus the largest pass of any role.
    The rollout holds util·GPU while it generates; with `free_cache_engine` it frees it for the training
    passes (`RolloutWorker.release_memory`): vLLM sleeps at level 2 (weights and cache discarded), the HF
    engine returns its cache and keeps its weights. The weight sync is one pass: the actor rank's sending
    rows, the replica's receiving rows and (vLLM) its woken weights."""
    free = bool(cfg.actor_rollout_ref.rollout.free_cache_engine)
    sleeps = cfg.actor_rollout_ref.rollout.name == "vllm"
    g = RolePlan("GPU shared by all roles", budget=gpu_mem)
    for role in roles:
        for row in [*role.rows, *role.beside]:
            phase = f"{role.role} {row.phase}" if row.phase else ""
            if row.phase == "sync":
                phase = "weight sync"  # the actor's rank sends, its replica receives, at once
            elif role.role == "rollout" and (row.name != "weights" or sleeps):
                phase = "rollout generate" if free else ""
            name = row.name if phase and phase.startswith(role.role) else f"{role.role} {row.name}"
            g.rows.append(Row(name, row.bytes, row.formula, phase))
            if role.role == "rollout" and row.name == "weights" and sleeps and free:
                g.rows.append(
                    Row("rollout weights", row.bytes, row.formula + ", woken for the push", "weight sync")
                )
        if role.role == "rollout" and role.budget is not None:
            reserved = role.budget - role.total
            g.rows.append(
                Row(
                    "rollout reserved rest",
                    max(0, reserved),
                    "util·GPU − what it needs",
                    "rollout generate" if free else "",
                )
            )
    g.note = "passes never overlap (sync step order); " + (
        "free_cache_engine: the rollout's memory is released while training"
        + (
            " (vLLM sleep level 2: weights and cache discarded, the next push fills the woken weights)"
            if sleeps
            else " (its weights stay)"
        )
        if free
        else "the rollout keeps its reservation throughout"
    )
    return g


def _host_plans(
    cfg: Any, s: ModelShape, lay: Layout, roles: list[RolePlan], host_mem: int | None
) -> list[RolePlan]:
    """Host RAM of node 0 (the driver's) and, for several nodes, of every other node."""
    out = []
    for node in [0, 1] if lay.colocated and lay.nnodes > 1 else [0]:
        h = RolePlan(
            f"host RAM, node {node}" if not node else f"host RAM, nodes 1-{lay.nnodes - 1}", budget=host_mem
        )
        h.rows.append(Row("Ray", RAY_NODE_BYTES, "raylet, GCS, dashboard (assumed)"))
        if node == 0:
            h.rows.append(Row("driver", DRIVER_BYTES, "dapo train: flow, Prefect client, store (assumed)"))
        for role in roles:
            if not lay.colocated and node:
                continue
            procs = role.procs_per_node
            per = role.total if lay.device == "cpu" else role.host_total
            h.rows.append(
                Row(f"{role.role} × {procs}", per * procs, f"{procs} × {_gib(per)} (peak of one process)")
            )
        out.append(h)
    return out


def gpu_budget(gpu_mem: str | None) -> tuple[int | None, str]:
    """The per-GPU memory to check against: `--gpu-mem`, else the first visible CUDA device, else None."""
    if gpu_mem:
        return parse_bytes(gpu_mem), f"--gpu-mem {gpu_mem}"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"CUDA device 0 ({props.name})"
    return None, "no GPU budget known"


def host_memory(field_name: str = "MemTotal") -> int | None:
    """This machine's RAM (`MemTotal`, or `MemAvailable`) from /proc/meminfo; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_budget_problem(cfg: Any, gpu_mem: str | None) -> str | None:
    """For `dapo train`: one paragraph when `cfg` runs on GPUs but their memory is unknown (no `--gpu-mem`, no
    CUDA device visible to the driver), else None. A plan with no budget checks nothing, so the run is refused
    rather than guessed."""
    if gpu_mem or str(cfg.trainer.device) != "cuda":
        return None
    budget, _ = gpu_budget(None)
    if budget is not None:
        return None
    return (
        "dapo train: trainer.device=cuda but this machine sees no GPU, so the memory plan has no per-GPU "
        "budget and cannot tell whether the run fits. Pass the memory of one GPU of the cluster, e.g. "
        "`dapo train --gpu-mem 80GiB ...` (`dapo plan --gpu-mem 80GiB ...` shows the plan first)."
    )


def advise(
    cfg: Any,
    check: str,
    *,
    gpu_mem: int | None,
    host_mem: int | None,
    model_config: str | None = None,
    dp: int = 1,
) -> list[str]:
    """Config changes (dotted overrides, space-separated) that make the failing `check` (a role, the shared
    GPU or a host) fit; each one verified by re-planning (plan_advice.py)."""
    return search(
        cfg,
        check,
        lambda c: make_plan(c, gpu_mem=gpu_mem, model_config=model_config, dp=dp, host_mem=host_mem),
    )


def host_ram_problem(
    cfg: Any, available: int | None = None, *, model_config: str | None = None
) -> str | None:
    """For a CPU run's preflight: one paragraph when the plan's host RAM of this node (every process's peak,
    Ray, the driver) exceeds `available` bytes (default: /proc/meminfo MemAvailable), with the config changes
    that make it fit; None when it fits, the run is on GPUs, or no plan can be made."""
    if _plan_device(cfg) != "cpu":
        return None
    available = available if available is not None else host_memory("MemAvailable")
    try:
        plan = make_plan(cfg, model_config=model_config, host_mem=available)
    except PlanError:
        return None
    node = plan.hosts[0]
    if node.fits() is not False:
        return None
    knobs = advise(cfg, node.role, gpu_mem=None, host_mem=available, model_config=model_config)
    fix = "; or ".join(knobs) if knobs else f"a machine with more memory ({_largest(node)})"
    return (
        f"The run's processes need about {_gib(node.total)} of RAM on this machine (memory plan: "
        f"{', '.join(f'{r.name} {_gib(r.bytes)}' for r in node.rows)}) but {_gib(available)} is available. "
        f"Change: {fix} (`dapo plan --config ...` shows every row)."
    )


EXIT_UNKNOWN_BUDGET = 3
"""`dapo plan`'s exit status when a GPU config's per-GPU memory is unknown: the plan is printed, nothing is
checked (0 = it fits, 2 = it does not fit or cannot be made)."""


def run_plan(
    cfg: Any,
    command: str,
    *,
    gpu_mem: str | None = None,
    model_config: str | None = None,
    dp: int = 1,
    out: Any = None,
    host_mem: str | None = None,
) -> int:
    """Print the plan of `cfg`; return 0 when it fits, 2 when a check fails (with the changes that fix it),
    `EXIT_UNKNOWN_BUDGET` for `dapo plan` on a GPU config without a GPU budget.

    `command` is "plan" or "train": for `dapo train` a plan that cannot be made (no model shape known) is a
    note, not an error, and a GPU config without a known GPU budget is refused (`gpu_budget_problem`).
    """
    import sys

    out = out or sys.stdout
    try:
        device = _plan_device(cfg)
        budget, where = gpu_budget(gpu_mem)
        if device == "cpu":
            budget, where = None, "trainer.device=cpu: memory of each process (host RAM)"
        here = device == "cpu" or (
            gpu_mem is None and budget is not None
        )  # this machine is a node of the run
        hmem = parse_bytes(host_mem) if host_mem else (host_memory() if here else None)
        plan = make_plan(cfg, gpu_mem=budget, model_config=model_config, dp=dp, host_mem=hmem)
    except PlanError as e:
        if command == "train":
            print(f"dapo train: note: no memory plan ({e})", file=sys.stderr)
            return 0
        print(f"dapo {command}: {e}", file=sys.stderr)
        return 2
    print(f"dapo {command}: memory plan ({where})", file=out)
    failures = plan.failures()
    for check in failures:
        check.knobs = advise(cfg, check.role, gpu_mem=budget, host_mem=hmem, model_config=model_config, dp=dp)
    print(plan.render(), file=out, flush=True)
    if device == "cuda" and budget is None:
        if command == "train":
            print(gpu_budget_problem(cfg, None) or "", file=sys.stderr, flush=True)
            return 2
        print(
            f"dapo plan: unknown budget: no --gpu-mem and no GPU here, so nothing was checked (exit "
            f"{EXIT_UNKNOWN_BUDGET}); pass --gpu-mem, e.g. 80GiB.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_UNKNOWN_BUDGET
    if not failures:
        return 0
    lines = [
        f"dapo {command}: {r.role} needs {_gib(r.total)} but has {_gib(r.budget)}; change: "
        + (
            "; or ".join(r.knobs)
            if r.knobs
            else f"no setting of the memory keys fits ({_largest(r)}); more or larger GPUs/RAM"
        )
        + "."
        for r in failures
    ]
    if command == "train":
        lines.append("dapo train: refusing to start a run that cannot fit (see the plan above).")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 2


def measure_actor_update(
    cfg: Any, model_path: str, *, device: str = "cpu", seed: int = 0, steps: int = 1
) -> dict[str, int]:
    """Measure the peak memory of actor updates above the loaded weights, next to the plan's estimate.

    Builds the `ActorWorker` as flows/roles.py does and runs `update_actor` `steps` times on one
    mini-batch of rows at full width (max_prompt_length + max_response_length, the plan's worst case); with
    `use_shared_prompt` the n rows of each group share their prompt, as generated rows do.
    On CPU the peak is the process's resident high-water mark (VmHWM, reset through
    /proc/self/clear_refs after the weights are loaded) minus the resident size then; on CUDA it is
    `torch.cuda.max_memory_allocated` minus the allocation after loading. Returns `measured` and
    `estimated` bytes (the plan's actor rows except the weights, with the update pass) and `weights`
    (the plan's weight row).
    """

    import dataclasses

    import pyarrow as pa
    import torch

    from dapo_core.compute.workers.actor import ActorWorker

    arr = cfg.actor_rollout_ref
    rows = int(arr.actor.ppo_mini_batch_size) * int(arr.rollout.n)
    P, R = int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)
    worker = ActorWorker(
        model_path,
        dataclasses.asdict(arr.actor),
        pad_token_id=0,
        temperature=1.0,
        rollout_n=int(arr.rollout.n),
        total_steps=10,
        device=device,
        seed=seed,
        gradient_checkpointing=bool(arr.model.enable_gradient_checkpointing),
        use_remove_padding=bool(arr.model.use_remove_padding),
        use_shared_prompt=bool(arr.model.use_shared_prompt),
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (rows, P + R), generator=g)
    if arr.model.use_shared_prompt:  # as generated: the n rows of a group share their prompt
        n = int(arr.rollout.n)
        ids[:, :P] = ids[::n, :P].repeat_interleave(n, dim=0)[:rows]
    table = pa.table(
        {
            "prompt_ids": pa.array(ids[:, :P].tolist(), type=pa.list_(pa.int32())),
            "response_ids": pa.array(ids[:, P:].tolist(), type=pa.list_(pa.int32())),
            "old_log_probs": pa.array((-4.6 * torch.ones(rows, R)).tolist(), type=pa.list_(pa.float32())),
            "advantages": pa.array(torch.randn(rows, R, generator=g).tolist(), type=pa.list_(pa.float32())),
        }
    )
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for step in range(steps):
            worker.update_actor(table, step)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    else:
        base = rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        for step in range(steps):
            worker.update_actor(table, step)
        measured = rss_bytes("VmHWM") - base
    plan = make_plan(cfg, device=device)
    actor = next(r for r in plan.roles if r.role == "actor")
    weights = sum(r.bytes for r in actor.rows if r.name == "weights")
    estimated = sum(
        r.bytes for r in actor.rows if r.phase in ("", "update") and r.name not in ("weights", "process")
    )
    return {"measured": int(measured), "estimated": int(estimated), "weights": int(weights)}


def measure_rollout(cfg: Any, model_path: str, *, device: str = "cpu", seed: int = 0) -> dict[str, int]:
    """Measure the peak memory of one HF-engine generation above the loaded weights, next to the plan's.

    One batch of `min(gen batch × n, max_num_seqs)` rows: `n` samples of each of `rows / n` random prompts of
    `max_prompt_length` tokens, `max_response_length` new tokens (EOS is an id the model almost never draws,
    so rows run to full length: the plan's worst case). Measured as in `measure_actor_update`; `estimated` is
    the plan's rollout rows except the weights, the process and the push's pass, `weights` its weight row.
    """
    import torch

    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
    from dapo_core.compute.engines.rollout import SamplingParams

    ro = cfg.actor_rollout_ref.rollout
    n, P, R = int(ro.n), int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)
    rows = min(int(cfg.data.gen_batch_size or cfg.data.train_batch_size) * n, int(ro.max_num_seqs))
    dtype = "float32" if str(ro.dtype) == "auto" else str(ro.dtype)
    vocab = resolve_shape(cfg).vocab_size
    if device == "cuda":
        torch.cuda.synchronize()
    engine = HFRolloutEngine(
        model_path, device=device, seed=seed, dtype=dtype, max_batch_size=rows, eos_token_id=vocab - 1
    )
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab - 1, (P,), generator=g).tolist() for _ in range(-(-rows // n))]
    batch = [prompts[i // n] for i in range(rows)]
    params = SamplingParams(temperature=1.0, max_new_tokens=R)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.generate(batch, params, list(range(rows)))
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    else:
        base = rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        engine.generate(batch, params, list(range(rows)))
        measured = rss_bytes("VmHWM") - base
    rollout = next(r for r in make_plan(cfg, device=device).roles if r.role == "rollout")
    estimated = _peak([r for r in rollout.rows if r.name not in ("weights", "process") and r.phase != "sync"])
    weights = sum(r.bytes for r in rollout.rows if r.name == "weights")
    return {"measured": int(measured), "estimated": int(estimated), "weights": int(weights), "rows": rows}
