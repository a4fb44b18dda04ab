"""Small table helpers of the rollout-side tasks of both step orders: list lengths read memory-mapped, group
checks and selections by uid, the balanced row order, and Arrow IPC bytes for ledger payloads.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.data import batch as B
from tasks.runtime import Runtime


def lengths_of(rt: Runtime, uris: list[str]) -> pa.Table:
    """`uid`, `sample_idx`, `prompt_ids` and `response_ids` lengths of the concatenated views at `uris` (list
    offsets only, memory-mapped: no token is read)."""
    return pa.concat_tables([rt.store.read_lengths(u, ["prompt_ids", "response_ids"]) for u in uris])


def check_whole_groups(table: pa.Table, n: int, where: str) -> None:
    """Raise when a uid of `table` (a selection) does not have exactly `n` rows."""
    counts = pc.value_counts(table.column("uid"))
    bad = [c["values"] for c in counts.to_pylist() if c["counts"] != n]
    if bad:
        raise ValueError(f"{where}: groups {bad[:5]} do not have n={n} rows after selection")


def filter_metric(rt: Runtime) -> str:
    """`algorithm.filter_groups.metric` (the config checks require it whenever dynamic sampling is on)."""
    metric = rt.cfg.algorithm.filter_groups.metric
    if metric is None:
        raise ValueError("algorithm.filter_groups.metric: required with filter_groups.enable — use acc")
    return metric


def balanced_order(rt: Runtime, lengths: pa.Table) -> np.ndarray:
    """The row order for equal per-rank token loads (`B.balance_order`, one training process) of a batch with
    these `prompt_ids`/`response_ids` lengths (`lengths_of`); the identity unless `trainer.balance_batch`."""
    if not rt.cfg.trainer.balance_batch:
        return np.arange(lengths.num_rows, dtype=np.int64)
    seqlens = lengths.column("prompt_ids").to_numpy().astype(np.int64) + lengths.column(
        "response_ids"
    ).to_numpy().astype(np.int64)
    return B.balance_order(seqlens, dp_size=1)


def uids_of(table: pa.Table) -> list[str]:
    """The group uids of `table`, in order of first appearance."""
    return list(dict.fromkeys(table.column("uid").to_pylist()))


def rows_of(table: pa.Table, uids: list[str]) -> pa.Table:
    """The rows of `table` whose uid is in `uids` (table order)."""
    return table.filter(pc.is_in(table.column("uid"), value_set=pa.array(uids, pa.string())))


def to_ipc(table: pa.Table) -> bytes:
    """`table` as Arrow IPC stream bytes (a ledger payload)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    """The table `to_ipc` wrote."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
