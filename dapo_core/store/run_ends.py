"""Run-length ends: per-token list columns of the form ``[b, b, …, b, e]`` stored as one ``(n, body, last)``.

A ``list<int or float>`` column without nulls whose every row is one value repeated, possibly with another
last value, is stored as ``struct<n: int32, body, last>`` per row and listed in the manifest's ``encoded``
(``{column: "ends"}``); a read expands it back to the same ``list<…>`` values, bit for bit. GRPO's
advantages and returns, token-level rewards and an all-ones response mask are such columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.store.manifests import StoreCorruption

__all__ = ["ENDS", "decode_file_table", "encode_file_table"]

ENDS = "ends"
"""The ``encoded`` kind of a list column stored as one ``(n, body, last)`` per row."""


def _ends_type(field: pa.Field) -> pa.DataType | None:
    """The value type of a column that may be stored as run-length ends, or None."""
    t = field.type
    if not pa.types.is_list(t) or t != pa.list_(t.value_type):  # plain list<item> only
        return None
    vt = t.value_type
    if not (pa.types.is_integer(vt) or pa.types.is_floating(vt)):
        return None
    return vt


def _encode_chunk(chunk: pa.ListArray, vt: pa.DataType) -> pa.StructArray | None:
    vals = chunk.flatten()
    if vals.null_count:
        return None
    v = vals.to_numpy(zero_copy_only=False)
    u = v.view(f"u{v.itemsize}")  # compare bits: -0.0 and NaN payloads must come back as they were
    lens = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(lens)
    starts = ends - lens
    full = lens > 0
    body = np.zeros(len(lens), dtype=u.dtype)
    last = np.zeros(len(lens), dtype=u.dtype)
    body[full] = u[starts[full]]
    last[full] = u[ends[full] - 1]
    long = lens > 2  # cheap rejection of ordinary columns: the second value of a row must be the first
    if not np.array_equal(u[starts[long] + 1], body[long]):
        return None
    expect = np.repeat(body, lens)
    expect[ends[full] - 1] = last[full]
    if not np.array_equal(expect, u):
        return None
    return pa.StructArray.from_arrays(
        [pa.array(lens.astype(np.int32)), pa.array(body.view(v.dtype), vt), pa.array(last.view(v.dtype), vt)],
        names=["n", "body", "last"],
    )


def _encode(col: pa.ChunkedArray, field: pa.Field) -> tuple[pa.ChunkedArray, pa.Field] | None:
    """``col`` as run-length ends and its file field, or None when some row is not ``[b, …, b, e]``, or the
    column has nulls or another type."""
    vt = _ends_type(field)
    if vt is None or col.null_count:
        return None
    chunks = []
    for chunk in col.chunks:
        enc = _encode_chunk(chunk, vt)
        if enc is None:
            return None
        chunks.append(enc)
    if sum(c.nbytes for c in chunks) >= col.nbytes:  # rows of 0-2 values: nothing to gain
        return None
    stype = pa.struct([("n", pa.int32()), ("body", vt), ("last", vt)])
    return (
        pa.chunked_array(chunks, type=stype),
        pa.field(field.name, stype, nullable=field.nullable, metadata=field.metadata),
    )


def _decode(col: pa.ChunkedArray, field: pa.Field, where: Path) -> tuple[pa.ChunkedArray, pa.Field]:
    """The ``list<…>`` column that :func:`_encode` stored as ``col``."""
    t = field.type
    if not (
        pa.types.is_struct(t) and [f.name for f in t] == ["n", "body", "last"] and t[1].type == t[2].type
    ):
        raise StoreCorruption(f"{where}: column {field.name!r} is marked run-length encoded but has type {t}")
    vt = t[1].type
    chunks = []
    for chunk in col.chunks:
        lens = pc.struct_field(chunk, "n").to_numpy(zero_copy_only=False).astype(np.int64)
        body = pc.struct_field(chunk, "body").to_numpy(zero_copy_only=False)
        last = pc.struct_field(chunk, "last").to_numpy(zero_copy_only=False)
        if len(lens) and lens.min() < 0:
            raise StoreCorruption(f"{where}: column {field.name!r} has a negative run length")
        ends = np.cumsum(lens)
        vals = np.repeat(body, lens)
        full = lens > 0
        vals[ends[full] - 1] = last[full]
        offsets = np.concatenate([[0], ends]).astype(np.int32)
        chunks.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(vals, vt), type=pa.list_(vt)))
    return (
        pa.chunked_array(chunks, type=pa.list_(vt)),
        pa.field(field.name, pa.list_(vt), nullable=field.nullable, metadata=field.metadata),
    )


def encode_file_table(file_table: pa.Table) -> tuple[pa.Table, dict[str, str]]:
    """``file_table`` with every column that can be stored as run-length ends so stored, and the manifest's
    ``encoded``."""
    encoded: dict[str, str] = {}
    cols, fields = [], []
    for field in file_table.schema:
        col = file_table.column(field.name)
        enc = _encode(col, field)
        if enc is not None:
            col, field = enc
            encoded[field.name] = ENDS
        cols.append(col)
        fields.append(field)
    if not encoded:
        return file_table, encoded
    return pa.Table.from_arrays(cols, schema=pa.schema(fields, metadata=file_table.schema.metadata)), encoded


def decode_file_table(table: pa.Table, man: dict[str, Any], path: Path) -> pa.Table:
    """The file table as written, with the manifest's ``encoded`` columns expanded back."""
    encoded = man.get("encoded") or {}
    if not encoded:
        return table
    if not isinstance(encoded, dict):
        raise StoreCorruption(f"{path}: its manifest's 'encoded' is not a mapping")
    cols, fields = [], []
    for field in table.schema:
        col = table.column(field.name)
        kind = encoded.get(field.name)
        if kind == ENDS:
            col, field = _decode(col, field, path)
        elif kind is not None:
            raise StoreCorruption(f"{path}: column {field.name!r} has an unknown encoding {kind!r}")
        cols.append(col)
        fields.append(field)
    return pa.Table.from_arrays(cols, schema=pa.schema(fields, metadata=table.schema.metadata))
