"""The batch contract: Arrow tables (one row per trajectory, no padding) and the tensors workers need.

Between stages a batch is a ``pyarrow.Table`` with one row per trajectory and list columns for
per-token data (see ``docs/ARCHITECTURE.md``, The batch contract). Workers turn rows into tensors
themselves with the helpers here:

- :func:`to_padded` — left-padded prompts, right-padded responses, ``input_ids``, masks, positions
  and any per-token column as a ``(B, L)`` tensor;
- :func:`from_padded` / :func:`add_token_column` / :func:`set_column` — the way back to list columns.

Row-level helpers (:func:`concat`, :func:`chunk`, :func:`repeat_interleave_prompts`) keep the table immutable
and zero-copy where Arrow allows. :func:`balance_partitions` / :func:`balance_batch` implement the
sequence-length balancing of the reference trainer (Karmarkar–Karp over the workload ``24576·len + len²``,
equal-size partitions, the NEWEST intra-partition order). All vectorised with numpy / pyarrow.compute.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

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
    "from_padded",
    "list_lengths",
    "prompt_lengths",
    "repeat_interleave_prompts",
    "response_lengths",
    "set_column",
    "to_padded",
]


class BatchError(ValueError):
    """A batch (Arrow table or tensor) does not fit the batch contract; the message names the column."""


# --------------------------------------------------------------------------------------------------
# small helpers


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


# --------------------------------------------------------------------------------------------------
# tensors -> rows


def from_padded(
    tensor: torch.Tensor,
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    dtype: pa.DataType | str | None = None,
) -> pa.ListArray:
    """Inverse of the right padding: keep the first ``lengths[i]`` entries of row ``i`` of a ``(B, L)`` tensor
    and return them as an Arrow list array.

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
    mask = ar < lens[:, None]
    values = pa.array(t[mask].numpy()).cast(arrow_type)
    offsets = np.zeros(B + 1, dtype=np.int32)
    np.cumsum(lens.numpy(), out=offsets[1:])
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


def repeat_interleave_prompts(table: pa.Table, n: int, *, uid_fn: Callable[[], str]) -> pa.Table:
    """Repeat every prompt row ``n`` times interleaved (``[p0×n, p1×n, …]``).

    Each source row gets one fresh ``uid`` (from ``uid_fn``, e.g. ``dapo_core.seeding.uid_factory``, shared by
    its ``n`` copies, replacing any existing uid: a uid names one *sampling* of a prompt) and ``sample_idx``
    0..n−1 (int32).
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


def balance_partitions(workloads: Sequence[int] | np.ndarray, k: int) -> list[list[int]]:
    """Karmarkar–Karp (largest differencing) split of row indices into ``k`` partitions of equal size and
    near-equal total workload; each partition's indices are sorted ascending.

    Needs ``len(workloads) % k == 0``; the states are seeded by k-tuples of consecutive items in ascending
    workload order, as the reference does.
    """
    w = [int(x) for x in np.asarray(workloads).tolist()]
    if k < 1:
        raise BatchError(f"balance_partitions: k must be ≥ 1, got {k}")
    if len(w) % k:
        raise BatchError(
            f"balance_partitions: {len(w)} rows cannot be split into {k} equal-size partitions; "
            f"make the batch size a multiple of dp_size"
        )
    if len(w) < k:
        raise BatchError(f"balance_partitions: {len(w)} rows for {k} partitions (each needs ≥ 1 row)")
    if k == 1:  # every merge joins the one set: Karmarkar–Karp's answer is all rows (no heap needed)
        return [list(range(len(w)))]
    order = sorted((wl, i) for i, wl in enumerate(w))
    heap = [_KKState([(i, wl) for wl, i in order[off : off + k]], k) for off in range(0, len(order), k)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    parts = [sorted(i for i, _ in s.items) for s in heap[0].sets]
    return parts


def balance_order(seqlens: Sequence[int] | np.ndarray, dp_size: int) -> np.ndarray:
    """Row permutation used by :func:`balance_batch`.

    Workload ``24576·len + len²`` → Karmarkar–Karp into ``dp_size`` equal-size partitions → inside each
    partition sort by workload ascending and lay out the even-position items followed by the
    odd-position items reversed (short–long–short, NEWEST). Rank ``r`` gets the ``r``-th block.
    """
    workloads = calculate_workload(seqlens)
    parts = balance_partitions(workloads, dp_size)
    perm: list[int] = []
    for part in parts:
        ranked = sorted(part, key=lambda i: (int(workloads[i]), i))
        perm.extend(ranked[0::2] + ranked[1::2][::-1])
    return np.asarray(perm, dtype=np.int64)


def balance_batch(table: pa.Table, dp_size: int) -> pa.Table:
    """Reorder rows so each of the ``dp_size`` contiguous equal blocks carries a similar workload
    (sequence length = prompt + response tokens). Advantages are grouped by uid, so this is safe."""
    seqlens = prompt_lengths(table) + response_lengths(table)
    perm = balance_order(seqlens, dp_size)
    return table.take(pa.array(perm))
