"""The formulas of a pass: activation bytes, the tokens of the largest micro-batch, the logits and their
float32 copies, a forward without gradients, and the rows of one pass (`_pass_rows`; `_shared_pass_rows` when
the forwards share prompts)."""

from __future__ import annotations

from typing import Any

from dapo_core.compute.plan.layout import Layout
from dapo_core.compute.plan.shape import ModelShape
from dapo_core.compute.plan.tables import RolePlan, Row
from dapo_core.compute.plan_advice import FSDP_STRATEGIES


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
