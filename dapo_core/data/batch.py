"""The batch contract: Arrow tables (one row per trajectory, no padding) and the tensors workers need.

Between stages a batch is a ``pyarrow.Table`` with one row per trajectory and list columns for
per-token data (see ``docs/INTERFACES.md`` § The batch contract). Workers turn rows into tensors
themselves with the helpers here:

- :func:`to_padded` — left-padded prompts, right-padded responses, ``input_ids``, masks, positions
  and any per-token column as a ``(B, L)`` tensor;
- :func:`to_packed` — padding-free layout (concatenated sequences + ``cu_seqlens``);
- :func:`from_padded` / :func:`from_packed` / :func:`add_token_column` — the way back to list columns.

Row-level helpers (:func:`concat`, :func:`select`, :func:`chunk`, :func:`reorder`, :func:`union`,
:func:`repeat_interleave_prompts`) keep the table immutable and zero-copy where Arrow allows.
:func:`balance_partitions` / :func:`balance_batch` implement the sequence-length balancing of the
reference trainer (Karmarkar–Karp over the workload ``24576·len + len²``, equal-size partitions,
and the NEWEST intra-partition order). Everything is vectorised with numpy / pyarrow.compute.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = [
    "BatchError",
    "add_token_column",
    "balance_batch",
    "balance_order",
    "balance_partitions",
    "calculate_workload",
    "chunk",
    "concat",
    "from_packed",
    "from_padded",
    "greedy_partitions",
    "group_sizes",
    "list_lengths",
    "prompt_lengths",
    "reorder",
    "repeat_interleave_prompts",
    "response_lengths",
    "select",
    "set_column",
    "to_packed",
    "to_padded",
    "union",
    "uuid4_hex",
]


class BatchError(ValueError):
    """A batch (Arrow table or tensor) does not fit the batch contract; the message names the column."""


# --------------------------------------------------------------------------------------------------
# small helpers


def uuid4_hex() -> str:
    """Return a fresh uuid4 as 32 lowercase hex characters (no dashes, no underscores)."""
    return uuid.uuid4().hex


def _list_array(table: pa.Table, name: str) -> pa.Array:
    """Return column ``name`` as one (Large)ListArray, raising a BatchError naming the column if absent."""
    if name not in table.column_names:
        raise BatchError(
            f"batch has no column {name!r} (columns: {table.column_names}); run the stage that adds it first"
        )
    col = table.column(name)
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise BatchError(f"column {name!r} must be a list column, got {arr.type}")
    return arr


def list_lengths(table: pa.Table, name: str) -> np.ndarray:
    """Per-row lengths of list column ``name`` as an int64 numpy array (null rows count as 0)."""
    arr = _list_array(table, name)
    return pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def prompt_lengths(table: pa.Table) -> np.ndarray:
    """Number of prompt tokens of every row (``prompt_ids`` lengths), int64."""
    return list_lengths(table, "prompt_ids")


def response_lengths(table: pa.Table) -> np.ndarray:
    """Number of response tokens of every row (``response_ids`` lengths), int64."""
    return list_lengths(table, "response_ids")


def _flat_values(arr: pa.Array) -> np.ndarray:
    """Flattened values of a list array (respecting slices) as numpy."""
    return arr.flatten().to_numpy(zero_copy_only=False)


def _torch_dtype_for(arrow_type: pa.DataType) -> torch.dtype:
    if pa.types.is_float64(arrow_type):
        return torch.float64
    if pa.types.is_floating(arrow_type):
        return torch.float32
    if pa.types.is_boolean(arrow_type):
        return torch.bool
    if pa.types.is_integer(arrow_type):
        return torch.int64
    raise BatchError(f"cannot turn list values of type {arrow_type} into a tensor")


_ARROW_FROM_TORCH = {
    torch.float32: pa.float32(),
    torch.float64: pa.float64(),
    torch.float16: pa.float32(),
    torch.bfloat16: pa.float32(),
    torch.int64: pa.int64(),
    torch.int32: pa.int32(),
    torch.int16: pa.int16(),
    torch.int8: pa.int8(),
    torch.uint8: pa.uint8(),
    torch.bool: pa.bool_(),
}


def _as_arrow_type(dtype: pa.DataType | str | None, fallback: torch.dtype) -> pa.DataType:
    if dtype is None:
        if fallback not in _ARROW_FROM_TORCH:
            raise BatchError(f"no Arrow type for tensor dtype {fallback}; pass dtype= explicitly")
        return _ARROW_FROM_TORCH[fallback]
    if isinstance(dtype, pa.DataType):
        return dtype
    try:
        return pa.type_for_alias(str(dtype))
    except (KeyError, ValueError) as exc:
        raise BatchError(f"unknown Arrow dtype {dtype!r}; use e.g. 'float32', 'int8', 'int32'") from exc


def _scatter_rows(
    arr: pa.Array, width: int, fill: float, dtype: torch.dtype, *, left: bool, name: str
) -> torch.Tensor:
    """Place each row of a list array into a ``(B, width)`` tensor, left- or right-aligned."""
    n = len(arr)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    if n and lengths.max(initial=0) > width:
        bad = int(np.argmax(lengths > width))
        raise BatchError(
            f"column {name!r}: row {bad} has {int(lengths[bad])} tokens but the padded width is {width}; "
            f"raise the max length or truncate the row"
        )
    values = _flat_values(arr)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    out = np.full((n, width), fill, dtype=np_dtype)
    if values.size:
        # Row-major boolean mask: its True cells are exactly the real tokens, in the order of the
        # flattened values (rows in order, each left- or right-aligned), so one masked assignment fills it.
        ar = np.arange(width)
        mask = ar >= (width - lengths)[:, None] if left else ar < lengths[:, None]
        out[mask] = values
    return torch.from_numpy(out)


# --------------------------------------------------------------------------------------------------
# rows -> tensors


def to_padded(
    table: pa.Table,
    pad_token_id: int,
    *,
    columns: Sequence[str] = (),
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> dict[str, torch.Tensor]:
    """Turn a batch into padded tensors.

    Returns ``prompts (B,P)`` left-padded with ``pad_token_id``, ``responses (B,L)`` right-padded,
    ``input_ids (B,P+L)``, ``attention_mask (B,P+L)`` (1 on real tokens), ``position_ids =
    clamp(cumsum(attention_mask) - 1, min=0)``, ``response_mask (B,L)`` (1 on the first
    ``len(response_ids)`` positions, or the ``response_mask`` column when the table has one),
    ``prompt_length (B,)`` / ``response_length (B,)``, and one ``(B,L)`` tensor per requested
    per-token column (padding 0; float columns as float32/float64, integer ones as int64).
    ``P``/``L`` default to the longest row; if given they must be ≥ every row (no silent truncation).
    Integer tensors are int64.
    """
    prompts_arr = _list_array(table, "prompt_ids")
    responses_arr = _list_array(table, "response_ids")
    p_len = pc.fill_null(pc.list_value_length(prompts_arr), 0).to_numpy(zero_copy_only=False)
    r_len = pc.fill_null(pc.list_value_length(responses_arr), 0).to_numpy(zero_copy_only=False)
    p_len = p_len.astype(np.int64)
    r_len = r_len.astype(np.int64)
    P = int(p_len.max(initial=0)) if max_prompt_length is None else int(max_prompt_length)
    L = int(r_len.max(initial=0)) if max_response_length is None else int(max_response_length)

    prompts = _scatter_rows(prompts_arr, P, pad_token_id, torch.int64, left=True, name="prompt_ids")
    responses = _scatter_rows(responses_arr, L, pad_token_id, torch.int64, left=False, name="response_ids")
    prompt_len_t = torch.from_numpy(p_len)
    resp_len_t = torch.from_numpy(r_len)
    prompt_mask = (torch.arange(P) >= (P - prompt_len_t)[:, None]).to(torch.int64)
    resp_valid = (torch.arange(L) < resp_len_t[:, None]).to(torch.int64)
    attention_mask = torch.cat([prompt_mask, resp_valid], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)

    if "response_mask" in table.column_names:
        response_mask = _scatter_rows(
            _list_array(table, "response_mask"), L, 0, torch.int64, left=False, name="response_mask"
        )
        if table.num_rows and not torch.equal(
            torch.from_numpy(list_lengths(table, "response_mask")), resp_len_t
        ):
            raise BatchError("column 'response_mask': list lengths differ from 'response_ids' lengths")
    else:
        response_mask = resp_valid.clone()

    out: dict[str, torch.Tensor] = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "prompt_length": prompt_len_t,
        "response_length": resp_len_t,
    }
    for name in columns:
        arr = _list_array(table, name)
        dtype = _torch_dtype_for(arr.type.value_type)
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
        if not np.array_equal(lengths.astype(np.int64), r_len):
            bad = int(np.argmax(lengths != r_len))
            raise BatchError(
                f"column {name!r}: row {bad} has {int(lengths[bad])} values but response_ids has "
                f"{int(r_len[bad])}; per-token columns must match the response length"
            )
        out[name] = _scatter_rows(arr, L, 0, dtype, left=False, name=name)
    return out


def to_packed(table: pa.Table, *, columns: Sequence[str] = ()) -> dict[str, Any]:
    """Padding-free layout: every row's ``prompt_ids + response_ids`` concatenated into one sequence.

    Returns ``input_ids (T,)`` int64, ``position_ids (T,)`` restarting at 0 for every sequence,
    ``cu_seqlens (B+1,)`` int32 (cumulative sequence starts, flash-attention style),
    ``prompt_length``/``response_length (B,)`` int64, ``response_mask (T,)`` int64 (1 on response
    tokens; the ``response_mask`` column's values if present), ``max_seqlen`` (int), and each requested
    per-token column as a ``(T,)`` tensor that is 0 on prompt positions.
    """
    prompts_arr = _list_array(table, "prompt_ids")
    responses_arr = _list_array(table, "response_ids")
    p_len = list_lengths(table, "prompt_ids")
    r_len = list_lengths(table, "response_ids")
    seq_len = p_len + r_len
    total = int(seq_len.sum())
    cu = np.zeros(len(seq_len) + 1, dtype=np.int64)
    np.cumsum(seq_len, out=cu[1:])
    seq_of_token = np.repeat(np.arange(len(seq_len)), seq_len)
    pos = np.arange(total, dtype=np.int64) - cu[:-1][seq_of_token]
    is_resp = pos >= p_len[seq_of_token]

    def _fill(prompt_vals: np.ndarray | None, resp_vals: np.ndarray, np_dtype: Any) -> np.ndarray:
        flat = np.zeros(total, dtype=np_dtype)
        if prompt_vals is not None:
            flat[~is_resp] = prompt_vals
        flat[is_resp] = resp_vals
        return flat

    input_ids = _fill(_flat_values(prompts_arr), _flat_values(responses_arr), np.int64)
    if "response_mask" in table.column_names:
        mask_vals = _flat_values(_list_array(table, "response_mask")).astype(np.int64)
        if mask_vals.size != int(r_len.sum()):
            raise BatchError("column 'response_mask': list lengths differ from 'response_ids' lengths")
        resp_mask = _fill(None, mask_vals, np.int64)
    else:
        resp_mask = is_resp.astype(np.int64)
    out: dict[str, Any] = {
        "input_ids": torch.from_numpy(input_ids),
        "position_ids": torch.from_numpy(pos),
        "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
        "prompt_length": torch.from_numpy(p_len),
        "response_length": torch.from_numpy(r_len),
        "response_mask": torch.from_numpy(resp_mask),
        "max_seqlen": int(seq_len.max(initial=0)),
    }
    for name in columns:
        arr = _list_array(table, name)
        if not np.array_equal(list_lengths(table, name), r_len):
            raise BatchError(f"column {name!r}: list lengths differ from 'response_ids' lengths")
        dtype = _torch_dtype_for(arr.type.value_type)
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        out[name] = torch.from_numpy(_fill(None, _flat_values(arr).astype(np_dtype), np_dtype))
    return out


# --------------------------------------------------------------------------------------------------
# tensors -> rows


def from_padded(
    tensor: torch.Tensor,
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    dtype: pa.DataType | str | None = None,
    left_padded: bool = False,
) -> pa.ListArray:
    """Inverse of the padding: keep the first ``lengths[i]`` entries of row ``i`` (the last ones if
    ``left_padded``) of a ``(B, L)`` tensor and return them as an Arrow list array.

    ``dtype`` (Arrow type or alias such as ``"float32"``) defaults to the tensor's dtype; bfloat16 /
    float16 become float32.
    """
    if tensor.dim() != 2:
        raise BatchError(f"from_padded expects a (B, L) tensor, got shape {tuple(tensor.shape)}")
    lens = torch.as_tensor(np.asarray(lengths, dtype=np.int64) if not torch.is_tensor(lengths) else lengths)
    lens = lens.to(torch.int64).cpu()
    B, L = tensor.shape
    if lens.shape != (B,):
        raise BatchError(f"from_padded: {lens.numel()} lengths for a batch of {B} rows")
    if B and (int(lens.min()) < 0 or int(lens.max()) > L):
        raise BatchError(f"from_padded: lengths must lie in [0, {L}] (the padded width)")
    arrow_type = _as_arrow_type(dtype, tensor.dtype)
    t = tensor.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    ar = torch.arange(L)
    mask = ar >= (L - lens)[:, None] if left_padded else ar < lens[:, None]
    values = pa.array(t[mask].numpy()).cast(arrow_type)
    offsets = np.zeros(B + 1, dtype=np.int32)
    np.cumsum(lens.numpy(), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def from_packed(
    flat: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prompt_lengths: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    *,
    dtype: pa.DataType | str | None = None,
) -> pa.ListArray:
    """Split a packed ``(T,)`` tensor back into rows (``cu_seqlens`` from :func:`to_packed`).

    With ``prompt_lengths`` the first ``prompt_lengths[i]`` entries of sequence ``i`` are dropped, so
    the result holds the per-response-token values (e.g. log-probs) of every row.
    """
    cu = torch.as_tensor(cu_seqlens).to(torch.int64).cpu().numpy()
    seq_len = np.diff(cu)
    if flat.dim() != 1 or flat.shape[0] != int(cu[-1]):
        raise BatchError(
            f"from_packed: tensor of shape {tuple(flat.shape)} does not match cu_seqlens[-1]={cu[-1]}"
        )
    t = flat.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    arrow_type = _as_arrow_type(dtype, flat.dtype)
    if prompt_lengths is None:
        skip = np.zeros_like(seq_len)
    else:
        skip = np.asarray(torch.as_tensor(prompt_lengths).cpu().numpy(), dtype=np.int64)
    keep_len = seq_len - skip
    if (keep_len < 0).any():
        raise BatchError("from_packed: a prompt length exceeds its sequence length")
    seq_of_token = np.repeat(np.arange(len(seq_len)), seq_len)
    pos = np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][seq_of_token]
    keep = pos >= skip[seq_of_token]
    values = pa.array(t.numpy()[keep]).cast(arrow_type)
    offsets = np.zeros(len(seq_len) + 1, dtype=np.int32)
    np.cumsum(keep_len, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


def set_column(table: pa.Table, name: str, arr: pa.Array | pa.ChunkedArray) -> pa.Table:
    """Add column ``name``, or replace it in place if the table already has one."""
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, arr)
    return table.append_column(name, arr)


def add_token_column(
    table: pa.Table, name: str, tensor: torch.Tensor, dtype: pa.DataType | str = "float32"
) -> pa.Table:
    """Add (or replace) per-token column ``name`` from a right-padded ``(B, L)`` tensor, cut to each
    row's ``response_ids`` length and stored as ``list<dtype>``."""
    lengths = response_lengths(table)
    if tensor.dim() != 2 or tensor.shape[0] != table.num_rows:
        raise BatchError(
            f"add_token_column({name!r}): expected a ({table.num_rows}, L) tensor, got {tuple(tensor.shape)}"
        )
    if table.num_rows and int(lengths.max()) > tensor.shape[1]:
        raise BatchError(
            f"add_token_column({name!r}): tensor width {tensor.shape[1]} is shorter than the longest "
            f"response ({int(lengths.max())}); compute it over the full padded response"
        )
    arr = from_padded(tensor, lengths, dtype=dtype)
    return set_column(table, name, arr)


# --------------------------------------------------------------------------------------------------
# row operations


def union(table: pa.Table, other: pa.Table) -> pa.Table:
    """Add the columns of ``other`` to ``table`` (same rows, same order). A column present in both must
    hold equal values (else BatchError naming it)."""
    if table.num_rows != other.num_rows:
        raise BatchError(f"union: row counts differ ({table.num_rows} vs {other.num_rows})")
    out = table
    for name in other.column_names:
        if name in out.column_names:
            if not out.column(name).equals(other.column(name)):
                raise BatchError(f"union: column {name!r} is in both tables with different values")
            continue
        out = out.append_column(other.schema.field(name), other.column(name))
    return out


def concat(tables: Sequence[pa.Table]) -> pa.Table:
    """Stack tables row-wise. All must have the same columns (order may differ; the first one's is kept)."""
    tables = list(tables)
    if not tables:
        raise BatchError("concat: no tables given")
    names = tables[0].column_names
    aligned = [tables[0]]
    for i, t in enumerate(tables[1:], start=1):
        if set(t.column_names) != set(names):
            missing = sorted(set(names) - set(t.column_names))
            extra = sorted(set(t.column_names) - set(names))
            raise BatchError(f"concat: table {i} columns differ (missing {missing}, extra {extra})")
        aligned.append(t.select(names))
    try:
        return pa.concat_tables(aligned)
    except pa.ArrowInvalid as exc:
        raise BatchError(f"concat: column types differ between tables: {exc}") from exc


def select(table: pa.Table, idx_or_mask: Any) -> pa.Table:
    """Rows by a boolean mask (length ``num_rows``) or by integer indices (any order, repeats allowed)."""
    if isinstance(idx_or_mask, torch.Tensor):
        idx_or_mask = idx_or_mask.cpu().numpy()
    if isinstance(idx_or_mask, (pa.Array, pa.ChunkedArray)):
        idx_or_mask = idx_or_mask.to_numpy(zero_copy_only=False)
    arr = np.asarray(idx_or_mask)
    if arr.dtype == bool:
        if arr.shape != (table.num_rows,):
            raise BatchError(f"select: mask has shape {arr.shape}, table has {table.num_rows} rows")
        return table.filter(pa.array(arr))
    if arr.size == 0:
        return table.slice(0, 0)
    if not np.issubdtype(arr.dtype, np.integer):
        raise BatchError(f"select: expected a bool mask or integer indices, got dtype {arr.dtype}")
    if arr.min() < -table.num_rows or arr.max() >= table.num_rows:
        raise BatchError(f"select: index out of range for {table.num_rows} rows")
    arr = np.where(arr < 0, arr + table.num_rows, arr)
    return table.take(pa.array(arr.astype(np.int64)))


def chunk(table: pa.Table, k: int) -> list[pa.Table]:
    """Split into ``k`` contiguous zero-copy slices whose sizes differ by at most one (larger first);
    ``concat(chunk(t, k))`` equals ``t``."""
    if k < 1:
        raise BatchError(f"chunk: k must be ≥ 1, got {k}")
    base, extra = divmod(table.num_rows, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(table.slice(start, size))
        start += size
    return out


def reorder(table: pa.Table, perm: Sequence[int] | np.ndarray | torch.Tensor) -> pa.Table:
    """Rows in the order ``perm`` (must be a permutation of ``range(num_rows)``)."""
    p = np.asarray(perm.cpu().numpy() if isinstance(perm, torch.Tensor) else perm, dtype=np.int64)
    if p.shape != (table.num_rows,) or not np.array_equal(np.sort(p), np.arange(table.num_rows)):
        raise BatchError(f"reorder: perm is not a permutation of range({table.num_rows})")
    return table.take(pa.array(p))


def repeat_interleave_prompts(table: pa.Table, n: int, *, uid_fn: Callable[[], str] = uuid4_hex) -> pa.Table:
    """Repeat every prompt row ``n`` times interleaved (``[p0×n, p1×n, …]``).

    Each source row gets one fresh ``uid`` (from ``uid_fn``, shared by its ``n`` copies, replacing any
    existing uid: a uid names one *sampling* of a prompt) and ``sample_idx`` 0..n−1 (int32).
    """
    if n < 1:
        raise BatchError(f"repeat_interleave_prompts: n must be ≥ 1, got {n}")
    rows = table.num_rows
    take = np.repeat(np.arange(rows, dtype=np.int64), n)
    out = table.take(pa.array(take))
    uids = [uid_fn() for _ in range(rows)]
    if len(set(uids)) != rows:
        raise BatchError("repeat_interleave_prompts: uid_fn returned duplicate uids")
    uid_col = pa.array(np.repeat(np.array(uids, dtype=object), n), pa.string())
    sample_col = pa.array(np.tile(np.arange(n, dtype=np.int32), rows), pa.int32())
    out = set_column(out, "uid", uid_col)
    return set_column(out, "sample_idx", sample_col)


def group_sizes(table: pa.Table) -> dict[str, int]:
    """Number of rows per ``uid``, in order of first appearance."""
    if "uid" not in table.column_names:
        raise BatchError("group_sizes: batch has no 'uid' column")
    vc = pc.value_counts(table.column("uid"))
    return dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True))


# --------------------------------------------------------------------------------------------------
# sequence-length balancing


def calculate_workload(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Approximate per-sequence compute (NEWEST reference): ``24576·len + len²`` (linear MLP/projection
    cost plus quadratic attention), as int64."""
    x = np.asarray(lengths, dtype=np.int64)
    return 24576 * x + x * x


class _KKSet:
    """One partition inside a Karmarkar–Karp state."""

    __slots__ = ("items", "sum")

    def __init__(self) -> None:
        self.sum = 0
        self.items: list[tuple[int, int]] = []  # (index, workload)

    def key(self) -> tuple:
        return (self.sum, len(self.items), self.items)


class _KKState:
    """k partitions kept sorted by descending (sum, size, items); ordered in the heap by spread."""

    __slots__ = ("sets",)

    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.sets = [_KKSet() for _ in range(k)]
        for s, (idx, w) in zip(self.sets, items, strict=False):
            s.items.append((idx, w))
            s.sum += w
        self.sets.sort(key=_KKSet.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def merge(self, other: _KKState) -> None:
        k = len(self.sets)
        for i in range(k):
            mine, theirs = self.sets[i], other.sets[k - 1 - i]
            mine.items.extend(theirs.items)
            mine.sum += theirs.sum
        self.sets.sort(key=_KKSet.key, reverse=True)

    def __lt__(self, other: _KKState) -> bool:
        # heapq is a min-heap: the state with the LARGEST spread must come out first.
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0].key() > other.sets[0].key()


def balance_partitions(
    workloads: Sequence[int] | np.ndarray, k: int, equal_size: bool = True
) -> list[list[int]]:
    """Karmarkar–Karp (largest differencing) split of row indices into ``k`` partitions of near-equal
    total workload; each partition's indices are sorted ascending.

    ``equal_size=True`` needs ``len(workloads) % k == 0`` and gives every partition the same count
    (seeded by k-tuples of consecutive items in ascending workload order, as the reference does).
    """
    w = [int(x) for x in np.asarray(workloads).tolist()]
    if k < 1:
        raise BatchError(f"balance_partitions: k must be ≥ 1, got {k}")
    if equal_size and len(w) % k:
        raise BatchError(
            f"balance_partitions: {len(w)} rows cannot be split into {k} equal-size partitions; "
            f"make the batch size a multiple of dp_size or pass equal_size=False"
        )
    if len(w) < k:
        raise BatchError(f"balance_partitions: {len(w)} rows for {k} partitions (each needs ≥ 1 row)")
    order = sorted((wl, i) for i, wl in enumerate(w))
    heap: list[_KKState] = []
    if equal_size:
        for off in range(0, len(order), k):
            heap.append(_KKState([(i, wl) for wl, i in order[off : off + k]], k))
    else:
        heap = [_KKState([(i, wl)], k) for wl, i in order]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    parts = [sorted(i for i, _ in s.items) for s in heap[0].sets]
    return parts


def greedy_partitions(
    workloads: Sequence[int] | np.ndarray, k: int, equal_size: bool = True
) -> list[list[int]]:
    """Baseline: largest-first, each item to the lightest partition (among those with room when
    ``equal_size``). Used to compare against :func:`balance_partitions`."""
    w = np.asarray(workloads, dtype=np.int64)
    if equal_size and len(w) % k:
        raise BatchError(f"greedy_partitions: {len(w)} rows not divisible by k={k}")
    cap = len(w) // k if equal_size else len(w)
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(w)), key=lambda j: (-int(w[j]), j)):
        choices = [p for p in range(k) if len(parts[p]) < cap]
        p = min(choices, key=lambda q: (sums[q], q))
        parts[p].append(i)
        sums[p] += int(w[i])
    return [sorted(p) for p in parts]


def balance_order(seqlens: Sequence[int] | np.ndarray, dp_size: int) -> tuple[np.ndarray, list[list[int]]]:
    """Row permutation used by :func:`balance_batch` and the partitions behind it.

    Workload ``24576·len + len²`` → Karmarkar–Karp into ``dp_size`` equal-size partitions → inside each
    partition sort by workload ascending and lay out the even-position items followed by the
    odd-position items reversed (short–long–short, NEWEST). Rank ``r`` gets the ``r``-th block.
    """
    workloads = calculate_workload(seqlens)
    parts = balance_partitions(workloads, dp_size, equal_size=True)
    perm: list[int] = []
    for part in parts:
        ranked = sorted(part, key=lambda i: (int(workloads[i]), i))
        perm.extend(ranked[0::2] + ranked[1::2][::-1])
    return np.asarray(perm, dtype=np.int64), parts


def balance_batch(table: pa.Table, dp_size: int) -> pa.Table:
    """Reorder rows so each of the ``dp_size`` contiguous equal blocks carries a similar workload
    (sequence length = prompt + response tokens). Advantages are grouped by uid, so this is safe."""
    seqlens = prompt_lengths(table) + response_lengths(table)
    perm, _ = balance_order(seqlens, dp_size)
    return table.take(pa.array(perm))
