"""What a rank of a trained (or frozen) model holds throughout: weights, gradients and optimizer state under
the torch, DeepSpeed and FSDP2 engines, on the device or the host (`_train_states`), and the process itself
(`PROCESS_BYTES`, the NCCL buffers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo_core.compute.plan.layout import Layout
from dapo_core.compute.plan.shape import GiB, LoraShape, ModelShape
from dapo_core.compute.plan.tables import RolePlan, Row
from dapo_core.compute.plan_advice import FSDP_STRATEGIES

PROCESS_BYTES = {"cpu": 481_932 << 10, "cuda": 3 * GiB}
"""Resident memory of a worker process before it loads a model. cpu: the VmRSS of a Ray actor that has
imported torch, transformers and the dapo workers (one thread); cuda: assumed (Python, torch, the host side
of the CUDA context and its libraries)."""
NCCL_BUFFER_BYTES = 32 * 2 * (4 << 20)
"""Assumed host RAM of one GPU process's NCCL communicator: NCCL's default NCCL_BUFFSIZE (4 MiB, the Simple
protocol's buffer) per channel and ring direction, for the 32 channels NCCL opens at most, pinned on the host
for its network proxy (no GPUDirect RDMA)."""
FSDP_BYTES = 4
"""Bytes per value of the fsdp2 engine's weights, gradients and activations: it trains in float32 (no mixed
precision)."""


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
    s: ModelShape,
    lay: Layout,
    section: Any,
    *,
    params: int,
    trained: bool,
    dtype_bytes: int = 4,
    lora: LoraShape | None = None,
) -> _States:
    """Rows of the weights, gradients and AdamW state of one rank under `lay.strategy` (and where they live).

    torch: everything float32 on the device (`dtype_bytes` for a frozen model). DeepSpeed: ZeRO stage s
    shards optimizer (s ≥ 1), gradients (s ≥ 2) and weights (s = 3) over `lay.dp`; `offload_*` move them to
    the host. FSDP2: float32 shards of weights, gradients and AdamW m, v over dp, each decoder layer gathered
    in full while it runs (with the next one prefetched), float32 compute. Under bf16 mixed precision
    (`fsdp_config.mixed_precision.param_dtype`) the passes compute in 2 bytes: FSDP2 gathers bf16 layers,
    the torch engine's autocast holds a bf16 copy of every weight through a pass.

    With `lora` (every engine) the P base weights are frozen in the engine's weight dtype (float32 on the
    torch and fsdp2 engines, which never cast them; the module's bf16 under DeepSpeed's `bf16`) beside the
    adapters' P_lora, and only the adapters have gradients and optimizer state (ZeRO partitions the
    adapters' alone); FSDP2 shards the adapters with their layers and gathers a layer's adapters with it. A
    push carries the merged weights: P, not P + P_lora.
    """
    P, big, st = params, s.embedding_params, _States()
    A = lora.params if lora is not None and trained else 0
    LA = lora.layer_params if lora is not None and trained else 0
    PA = f"(P + P_lora {A:,})" if A else "P"
    G = "P_lora" if A else "P"
    opt = A if A else P
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
        st.dev.append(Row("weights", (P + A) * wb // dp, f"{PA}·{wb} B / dp {dp}"))
        if trained:
            st.dev.append(Row("gradients", opt * 4 // dp, f"{G}·4 B / dp {dp}"))
            st.dev.append(Row("optimizer", opt * 8 // dp, f"{G}·8 B (AdamW m + v) / dp {dp}"))
        head = 0 if s.tie_word_embeddings else big
        layer = s.layer_params + LA
        grads = (LA if A else s.layer_params) * 4 if trained else 0
        st.gathered = (2 * layer + big + head) * gb + grads
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
            work = 2 * (s.layer_params + LA) + big
            st.dev.append(Row("weights", work * wb, f"offload_param: (2 layers + embedding)·{wb} B gathered"))
            st.host.append(Row("weights", (P + A) * wb // dp, f"{PA}·{wb} B / dp {dp} (offload_param)"))
        else:
            div = dp if stage == 3 else 1
            st.dev.append(
                Row("weights", (P + A) * wb // div, f"{PA}·{wb} B" + (f" / dp {dp}" if div > 1 else ""))
            )
        gdiv = dp if stage >= 2 else 1
        if d.offload_optimizer:
            st.host.append(
                Row(
                    "optimizer",
                    opt * 16 // dp,
                    f"{G}·16 B / dp {dp} (fp32 master, m, v, fp32 gradients; CPU Adam)",
                )
            )
            if stage < 2:
                st.dev.append(Row("gradients", opt * wb, f"{G}·{wb} B"))
        else:
            st.dev.append(
                Row("gradients", opt * wb // gdiv, f"{G}·{wb} B" + (f" / dp {dp}" if gdiv > 1 else ""))
            )
            odiv = dp if stage >= 1 else 1
            what = "fp32 master + m + v" if opt_b == 12 else "AdamW m + v"
            st.dev.append(
                Row(
                    "optimizer",
                    opt * opt_b // odiv,
                    f"{G}·{opt_b} B ({what})" + (f" / dp {dp}" if odiv > 1 else ""),
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
        st.compute_bytes, st.autocast = 2, (P + A) * 2
    if lay.device == "cuda":
        st.host.append(Row("load", P * wb, f"P·{wb} B: read into host RAM, then moved", "load"))
    st.dev.append(Row("weights", (P + A) * wb, f"{PA}·{wb} B" + ("" if trained else " (forward only)")))
    if trained:
        st.dev.append(Row("gradients", opt * 4, f"{G}·4 B"))
        st.dev.append(Row("optimizer", opt * 8, f"{G}·8 B (AdamW m + v)"))
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
