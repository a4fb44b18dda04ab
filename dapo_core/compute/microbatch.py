"""Token-budget micro-batches and padding-free (packed) forward passes; both off by default.

- `token_budget_split(costs, budget)`: first-fit over the rows sorted longest first into micro-batches whose
  summed cost stays within a token budget (verl's `use_dynamic_bsz`); a row above the budget goes alone, and
  each group lists its rows in their original order. A row's cost is what the forward processes
  (`row_token_costs`: valid tokens when packed, the padded width when padded).
- `pack_rows(input_ids, attention_mask, response_length)`: a padded batch's valid tokens as one sequence
  (1, N), position ids restarting at 0 per row, the rows' boundaries (`cu_seqlens`, `max_seqlen`) for a
  variable-length attention kernel (`dapo_core.compute.varlen_attention`), and the indices that map logits
  back to (B, L).
- `shared_prompts(...)` finds the rows of a micro-batch that share their prompt, so a forward runs each
  distinct prompt once (`TrainEngine.forward(share_prompt=True)`); `group_rows(...)` lays each group out as
  one row (prompt, then its responses) with a (G, 1, T, T) mask in which a response sees its prompt and its
  own tokens only. Where that layout would not save positions, or its mask would be too large, the engine
  runs the prompts once with a KV cache instead. docs/ARCHITECTURE.md has the reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "GroupedRows",
    "PackedRows",
    "SharedPrompts",
    "group_rows",
    "grouped_order",
    "pack_rows",
    "row_token_costs",
    "shared_prompts",
    "token_budget_split",
]


def token_budget_split(costs: Sequence[int] | torch.Tensor, budget: int) -> list[list[int]]:
    """Partition row indices into groups with `Σ cost ≤ budget` (first-fit, longest first).

    A row whose own cost exceeds `budget` forms a group of its own. Groups are returned in the order they
    were opened; each lists its indices ascending. Deterministic: ties keep the original order.
    """
    if int(budget) < 1:
        raise ValueError(
            f"token budget {budget} must be >= 1 "
            "(ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu)."
        )
    values = [int(c) for c in (costs.tolist() if isinstance(costs, torch.Tensor) else costs)]
    if any(c < 0 for c in values):
        raise ValueError(f"token costs must be >= 0, got {min(values)}")
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        c = values[i]
        for g, load in enumerate(loads):
            if load + c <= budget:
                groups[g].append(i)
                loads[g] = load + c
                break
        else:
            groups.append([i])
            loads.append(c)
    return [sorted(g) for g in groups]


def row_token_costs(attention_mask: torch.Tensor, packed: bool) -> torch.Tensor:
    """Tokens each row costs a forward: its valid tokens when `packed`, else the padded width of the batch."""
    if packed:
        return attention_mask.sum(dim=1).to(torch.long)
    return torch.full((attention_mask.shape[0],), attention_mask.shape[1], dtype=torch.long)


@dataclass(frozen=True)
class PackedRows:
    """A padded batch's valid tokens as one sequence, and the map back to the (B, L) response grid."""

    input_ids: torch.Tensor
    """(1, N) the valid tokens of every row, rows one after another."""
    position_ids: torch.Tensor
    """(1, N) 0..len-1 within each row (the padded batch's position ids at its valid tokens)."""
    cu_seqlens: torch.Tensor
    """(B+1,) int32: row b's tokens are packed positions [cu_seqlens[b], cu_seqlens[b+1]) (0 first, N last; a
    row without valid tokens repeats the previous value)."""
    max_seqlen: int
    """The most valid tokens of any row (0 for a batch without any)."""
    logit_index: torch.Tensor
    """(M,) packed positions whose logits predict a response token (the token before it)."""
    label_index: torch.Tensor
    """(M,) packed positions of those response tokens."""
    rows: torch.Tensor
    """(M,) row of each response token in the (B, L) grid."""
    cols: torch.Tensor
    """(M,) column of each response token in the (B, L) grid."""
    batch_size: int
    """B."""
    response_length: int
    """L, the padded response width."""

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(M,) per-response-token values -> (B, L), zero where the padded grid has padding."""
        out = values.new_zeros((self.batch_size, self.response_length))
        out[self.rows, self.cols] = values
        return out


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> PackedRows:
    """Pack the valid tokens of a padded batch (prompts left-padded, responses right-padded).

    `input_ids`/`attention_mask` are (B, P+L); the response is the last `response_length` columns. Every row
    with a response token needs at least one prompt token (its first response token is predicted from it).
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"pack_rows: input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must be the same (B, P+L) shape."
        )
    B, T = input_ids.shape
    L = int(response_length)
    if L < 1 or L >= T:
        raise ValueError(f"response_length={L} must be in [1, {T - 1}] for sequences of width {T}.")
    valid = attention_mask.bool()
    lengths = valid.sum(dim=1)
    cu_seqlens = torch.zeros(B + 1, dtype=torch.int32, device=attention_mask.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    flat_index = torch.cumsum(valid.reshape(-1).to(torch.long), 0).reshape(B, T) - 1
    positions = torch.cumsum(valid.to(torch.long), dim=1) - 1
    resp_valid = valid[:, T - L :]
    rows, cols = resp_valid.nonzero(as_tuple=True)
    label_index = flat_index[rows, cols + (T - L)]
    # The token before a response token must be a valid token of the same row.
    prev_col = cols + (T - L) - 1
    if rows.numel() and not bool(valid[rows, prev_col].all()):
        bad = int(rows[~valid[rows, prev_col]][0])
        raise ValueError(
            f"pack_rows: row {bad} has a response token without a valid token before it (empty prompt?); "
            "a packed forward needs at least one prompt token per row."
        )
    return PackedRows(
        input_ids=input_ids[valid].unsqueeze(0),
        position_ids=positions[valid].unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()) if B else 0,
        logit_index=label_index - 1,
        label_index=label_index,
        rows=rows,
        cols=cols,
        batch_size=B,
        response_length=L,
    )


@dataclass(frozen=True)
class SharedPrompts:
    """The distinct prompts of a (B, P+L) batch and which of them each row has."""

    first: torch.Tensor
    """(U,) one row holding each distinct prompt (its first), U < B."""
    inverse: torch.Tensor
    """(B,) index into `first` of each row's prompt."""


def shared_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> SharedPrompts | None:
    """Group the rows of a padded batch by prompt (the first P = width − `response_length` columns, tokens and
    mask); None when every row's prompt is different (nothing to share).

    Two rows share a prompt when their masks and their tokens under the mask are equal; since the prompts are
    left-padded to the same width, their position ids are then equal too.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"shared_prompts: input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must be the same (B, P+L) shape."
        )
    B, T = input_ids.shape
    P = T - int(response_length)
    if P < 1 or B < 2:
        return None
    mask = attention_mask[:, :P].to(torch.long)
    key = torch.cat([input_ids[:, :P].to(torch.long) * mask, mask], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    if uniq.shape[0] == B:
        return None
    first = torch.full((uniq.shape[0],), B, dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(B), reduce="amin")
    # Number the distinct prompts in the order their first rows appear (stable, independent of token values).
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return SharedPrompts(first=first[order], inverse=rank[inverse])


MAX_GROUP_MASK_ELEMENTS = 1 << 24
"""`group_rows` declines when its attention mask would hold more elements than this (16 Mi booleans; SDPA may
widen it to float32, 64 MiB): long responses go the KV-cache way."""


@dataclass(frozen=True)
class GroupedRows:
    """A shared-prompt batch laid out one row per distinct prompt: its prompt (left-padded to a common width
    `prompt_width`), then the responses of its rows back to back, right-padded to the longest group."""

    input_ids: torch.Tensor
    """(G, T) tokens."""
    position_ids: torch.Tensor
    """(G, T) each token's position in its own row of the padded batch (a response restarts after the
    prompt)."""
    attend: torch.Tensor
    """(G, 1, T, T) bool, True where a query may attend to a key: a prompt token to the prompt tokens before
    it, a response token to its prompt and to its own response up to itself; padding only to itself."""
    prompt_width: int
    """Columns before the first response token; column `prompt_width - 1` holds every prompt's last token."""
    logit_index: torch.Tensor
    """(B, R) for each row and response position k < R, the column, counted from `prompt_width - 1`, whose
    logits predict that token: 0 (the prompt's last token) for k = 0, else the row's offset in its group + k.
    Clamped into range at padded positions, whose values are never used."""
    group: torch.Tensor
    """(B,) each row's group (its row of `input_ids`)."""
    response_width: int
    """R: the longest response of the batch (the log-prob grids are computed for the first R columns)."""

    @property
    def keep(self) -> int:
        """How many trailing columns the LM head must see (`logits_to_keep`): the last prompt token on."""
        return int(self.input_ids.shape[1]) - self.prompt_width + 1


def group_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    groups: SharedPrompts,
    max_mask_elements: int | None = None,
) -> GroupedRows | None:
    """Lay the (B, P+L) left/right-padded batch out one row per prompt group (`GroupedRows`); None when that
    does not pay: a group without prompt tokens, no fewer token positions than running the distinct prompts
    once plus every response padded to the longest (the KV-cache way), or a mask above `max_mask_elements`
    (default `MAX_GROUP_MASK_ELEMENTS`, read at call time).

    Pure tensor work (no model). The responses of a group keep the order of their rows in the batch."""
    B, width = input_ids.shape
    P = width - int(response_length)
    first, inverse = groups.first, groups.inverse
    G = int(first.numel())
    p_mask = attention_mask[first, :P].bool()
    if not bool(p_mask[:, -1].all()):  # left padding: an empty prompt has no last token
        return None
    start = int(p_mask.any(dim=0).nonzero()[0])
    p_mask = p_mask[:, start:]
    pw = P - start
    r_mask = attention_mask[:, P:].bool()
    r_len = r_mask.sum(dim=1)
    R = int(r_len.max()) if B else 0
    # Each row's offset in its group: exclusive cumulative length over the group's earlier rows.
    order = grouped_order(inverse)
    before = torch.cumsum(r_len[order], 0) - r_len[order]
    group_start = torch.zeros(G, dtype=before.dtype).scatter_reduce(
        0, inverse[order], before, reduce="amin", include_self=False
    )
    offset = torch.empty_like(r_len)
    offset[order] = before - group_start[inverse[order]]
    total = torch.zeros(G, dtype=r_len.dtype).index_add_(0, inverse, r_len)
    T = pw + int(total.max())
    limit = MAX_GROUP_MASK_ELEMENTS if max_mask_elements is None else max_mask_elements
    if G * pw + B * R <= G * T or limit < G * T * T:
        return None
    ids = input_ids.new_zeros((G, T))
    pos = position_ids.new_zeros((G, T))
    seg = torch.full((G, T), -2, dtype=torch.long)  # -1 prompt, -2 padding, b: a token of row b's response
    ids[:, :pw] = input_ids[first, start:P]
    pos[:, :pw] = position_ids[first, start:P]
    seg[:, :pw] = torch.where(p_mask, -1, -2)
    k = torch.arange(R)
    valid = r_mask[:, :R]
    rows = inverse[:, None].expand(B, R)[valid]
    cols = (pw + offset[:, None] + k[None, :])[valid]
    ids[rows, cols] = input_ids[:, P : P + R][valid]
    pos[rows, cols] = position_ids[:, P : P + R][valid]
    seg[rows, cols] = torch.arange(B)[:, None].expand(B, R)[valid]
    q, kk = seg[:, :, None], seg[:, None, :]
    attend = ((kk == -1) | ((q == kk) & (q >= 0))) & torch.ones(T, T, dtype=torch.bool).tril()
    attend |= torch.eye(T, dtype=torch.bool)  # no query without a key (padding; masked prompt columns)
    index = torch.where(k[None, :] == 0, 0, offset[:, None] + k[None, :]).clamp(max=T - pw)
    return GroupedRows(
        input_ids=ids,
        position_ids=pos,
        attend=attend[:, None],
        prompt_width=pw,
        logit_index=index,
        group=inverse,
        response_width=R,
    )


def grouped_order(keys: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """A permutation of the B rows that puts rows with equal `keys` (B,) next to each other, the rows of a
    group in their own order. Micro-batches sliced from a batch in this order hold whole prompt groups (what
    the shared-prompt forwards need), whatever order the batch came in (`trainer.balance_batch` sorts it by
    length).

    Without `lengths` the groups come in the order of their first row. With `lengths` (B,), e.g. each row's
    response tokens, they come longest first by their summed length (ties: order of first row), so each
    fixed-size micro-batch holds groups of similar size and pads less: a grouped row is the prompt width plus
    its group's responses back to back, and every row of a micro-batch is padded to the longest.
    """
    n = int(keys.numel())
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    _, inverse = torch.unique(keys, return_inverse=True)
    groups = int(inverse.max()) + 1
    first = torch.full((groups,), n, dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(n), reduce="amin")
    rank = first
    if lengths is not None:
        total = torch.zeros(groups, dtype=torch.long).index_add_(0, inverse, lengths.to(torch.long))
        rank = torch.empty(groups, dtype=torch.long)  # longest first; first < n + 1 breaks the ties
        rank[torch.argsort(first - total * (n + 1))] = torch.arange(groups)
    return torch.argsort(rank[inverse] * n + torch.arange(n))
