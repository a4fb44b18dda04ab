"""Column deltas and views: a stage stores only what it adds to the stages it was computed from.

A stage written over a base stores the row key ``_key`` (int64 from ``uid#sample_idx``), ``_src`` only when
its rows are a selection of the base rows (their positions in the concatenated base views), and the columns
that are new or differ from the base's. Its *view* (the table that was written) is assembled by aligned row
order — the base views concatenated, taken by ``_src``, the delta's columns attached — and checked: the rows'
keys must equal the delta's ``_key``. A table without ``uid``/``sample_idx``, or whose rows are not found in
its base, is stored whole.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.store.manifests import StoreCorruption, base_refs, schema_hash

__all__ = [
    "INTERNAL",
    "KEY_COLUMN",
    "SRC_COLUMN",
    "View",
    "assemble",
    "concat_views",
    "delta_file_table",
    "file_view",
    "row_keys",
    "selection_file_table",
]

KEY_COLUMN = "_key"
"""The row id column of every stage file whose table has ``uid`` and ``sample_idx``."""
SRC_COLUMN = "_src"
"""Positions of a selection's rows in the concatenated base views."""
INTERNAL = (KEY_COLUMN, SRC_COLUMN)
"""The store's own columns (a table written to the store may not have them)."""


def row_keys(table: pa.Table) -> pa.Array | None:
    """The row ids of ``table`` (int64, from ``uid`` and ``sample_idx``); None without those columns."""
    if "uid" not in table.column_names or "sample_idx" not in table.column_names:
        return None
    uids = table.column("uid").to_pylist()
    sidx = table.column("sample_idx").to_pylist()
    keys = np.fromiter(
        (
            int.from_bytes(
                hashlib.blake2b(f"{u}#{s}".encode(), digest_size=8).digest(), "little", signed=True
            )
            for u, s in zip(uids, sidx, strict=True)
        ),
        dtype=np.int64,
        count=len(uids),
    )
    return pa.array(keys, type=pa.int64())


def _concat_keys(keys: list[pa.Array | pa.ChunkedArray]) -> pa.ChunkedArray:
    chunks: list[pa.Array] = []
    for k in keys:
        chunks.extend(k.chunks if isinstance(k, pa.ChunkedArray) else [k])
    return pa.chunked_array(chunks, type=pa.int64())


class View:
    """An assembled stage view and its row keys (None: the table has no ``uid``/``sample_idx``)."""

    __slots__ = ("keys", "table")

    def __init__(self, table: pa.Table, keys: pa.Array | pa.ChunkedArray | None) -> None:
        self.table = table
        self.keys = None if keys is None else _concat_keys([keys])


def file_view(file_table: pa.Table, table: pa.Table | None = None) -> View:
    """The view of a file table stored without a base; or, given ``table``, the view of the table that was
    just written as ``file_table`` (whole or as a delta)."""
    if KEY_COLUMN not in file_table.column_names:
        return View(file_table if table is None else table, None)
    keys = file_table.column(KEY_COLUMN)
    return View(file_table.drop_columns([KEY_COLUMN]) if table is None else table, keys)


def concat_views(views: list[View]) -> View:
    """The views' rows one after the other (keys None if any view has none)."""
    if len(views) == 1:
        return views[0]
    tables = [v.table for v in views]
    keys = [v.keys for v in views]
    return View(
        pa.concat_tables(tables, promote_options="default"),
        None if any(k is None for k in keys) else _concat_keys([k for k in keys if k is not None]),
    )


def _keyed(table: pa.Table, keys: pa.Array | pa.ChunkedArray) -> pa.Table:
    return table.add_column(0, pa.field(KEY_COLUMN, pa.int64(), nullable=False), keys)


def delta_file_table(table: pa.Table, src: View | None) -> tuple[pa.Table, bool]:
    """The file table of ``table`` over the base view ``src`` and True, or — when it cannot be expressed over
    it (no base, no row ids, rows not in the base) — the whole table (with its keys, if any) and False."""
    if (
        src is not None
        and src.keys is not None
        and "uid" in table.column_names
        and "sample_idx" in table.column_names
    ):
        aligned = (
            table.num_rows == src.table.num_rows
            and "uid" in src.table.column_names
            and table.column("uid").equals(src.table.column("uid"))
            and table.column("sample_idx").equals(src.table.column("sample_idx"))
        )
        idx: pa.Array | None = None
        if aligned:
            keys: Any = src.keys
            base_rows: pa.Table | None = src.table
        else:
            keys = row_keys(table)
            pos = pc.index_in(keys, value_set=src.keys)
            if pos.null_count == 0:
                idx = pos.cast(pa.int64())
                base_rows = src.table.take(idx)
            else:
                base_rows = None
        if base_rows is not None:
            cols, fields = [_concat_keys([keys])], [pa.field(KEY_COLUMN, pa.int64(), nullable=False)]
            if idx is not None:
                cols.append(pa.chunked_array([idx]))
                fields.append(pa.field(SRC_COLUMN, pa.int64(), nullable=False))
            for f in table.schema:
                col = table.column(f.name)
                same = (
                    f.name in base_rows.column_names
                    and base_rows.schema.field(f.name).type == f.type
                    and base_rows.schema.field(f.name).nullable == f.nullable
                    and col.equals(base_rows.column(f.name))
                )
                if not same:
                    cols.append(col)
                    fields.append(f)
            return pa.Table.from_arrays(cols, schema=pa.schema(fields)), True
    keys = row_keys(table)
    return (table if keys is None else _keyed(table, keys)), False


def selection_file_table(keys: pa.ChunkedArray, idx: pa.Array) -> pa.Table:
    """The file table of rows ``idx`` of a base whose row keys are ``keys`` (only ``_key`` and ``_src``)."""
    return pa.Table.from_arrays(
        [keys.take(idx), idx],
        schema=pa.schema(
            [
                pa.field(KEY_COLUMN, pa.int64(), nullable=False),
                pa.field(SRC_COLUMN, pa.int64(), nullable=False),
            ]
        ),
    )


def _contiguous(idx: pa.ChunkedArray | pa.Array) -> tuple[int, int] | None:
    """``(start, length)`` when the positions ``idx`` are ``start, start + 1, …`` (else None)."""
    pos = np.concatenate(
        [
            c.to_numpy(zero_copy_only=False)
            for c in (idx.chunks if isinstance(idx, pa.ChunkedArray) else [idx])
        ]
        or [np.zeros(0, np.int64)]
    )
    if not len(pos) or pos[0] < 0 or not np.array_equal(pos, np.arange(pos[0], pos[0] + len(pos))):
        return None
    return int(pos[0]), len(pos)


def assemble(
    file_table: pa.Table,
    src: View,
    man: dict[str, Any],
    columns: frozenset[str] | None,
    where: str,
) -> View:
    """The view of the delta ``file_table`` (manifest ``man``) over its base view ``src`` (``columns``: only
    those; else the whole view, whose schema hash must be the manifest's). ``where`` names the stage."""
    table, keys = src.table, src.keys
    if keys is None:
        raise StoreCorruption(f"{where}: its base has no uid/sample_idx row ids")
    if SRC_COLUMN in file_table.column_names:
        idx = file_table.column(SRC_COLUMN)
        top = pc.max(idx).as_py() if table.num_rows else None
        if top is not None and top >= table.num_rows:
            raise StoreCorruption(f"{where}: selects rows beyond its base's {table.num_rows}")
        run = _contiguous(idx)
        if run is None:
            table, keys = table.take(idx), keys.take(idx)
        else:  # rows a..a+k in order (the whole base, or a prefix): a zero-copy slice, no take
            table, keys = table.slice(*run), keys.slice(*run)
    own = file_table.column(KEY_COLUMN)
    if not keys.equals(_concat_keys([own])):
        raise StoreCorruption(
            f"{where}: its row ids do not match the rows of its base {base_refs(man)} (the base was "
            f"rewritten without it): delete the stage and re-run it"
        )
    cols, fields = [], []
    for name in man["columns"]:
        if columns is not None and name not in columns:
            continue
        if name in file_table.column_names:
            cols.append(file_table.column(name))
            fields.append(file_table.schema.field(name))
        elif name in table.column_names:
            cols.append(table.column(name))
            fields.append(table.schema.field(name))
        else:
            raise StoreCorruption(f"{where}: column {name!r} is neither in the file nor in its base")
    view = pa.Table.from_arrays(cols, schema=pa.schema(fields))
    if columns is None and schema_hash(view.schema) != man["schema_hash"]:
        raise StoreCorruption(f"{where}: the assembled schema does not match the manifest's")
    return View(view, own)
