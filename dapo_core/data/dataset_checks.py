"""Checks of a user's dataset file in verl's / DAPO's parquet schema (docs/REFERENCE.md §8.1).

:func:`validate_dataset` checks a dataset table before anything trains on it: the required columns
(``data_source``, ``prompt`` messages, ``reward_model.ground_truth``), their Arrow types, then every row
(missing data sources, empty prompts, missing / empty / NaN ground truths, non-UTF-8 text), and raises one
:class:`DatasetError` naming the file, the column, up to 5 offending row numbers and the fix.
:func:`dataset_row_problems` gives the failing row checks of a table whose types are right.

Checked with pyarrow directly rather than pandera: the column *types* are checked first (a wrong type is
reported, never crashes a check), then vectorised row checks give the offending row numbers. The checks of the
pipeline's own stage files are in :mod:`dapo_core.data.schemas`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.data.schemas import MAX_UIDS_IN_MESSAGE, SchemaError
from dapo_core.errors import DapoUserError

__all__ = ["DatasetError", "dataset_row_problems", "validate_dataset"]


class DatasetError(SchemaError, DapoUserError):
    """A dataset file breaks verl's row schema; the message names the file, column, rows and the fix."""

    def __init__(self, message: str, failures: list[dict] | None = None) -> None:
        SchemaError.__init__(self, message, failures)
        self.what, self.where, self.fix = message, "", ""

    def __str__(self) -> str:
        return self.what


_DATASET_FIX = "regenerate the file with `dapo prepare`, or repair or drop those rows"
_STRING_TYPES = (pa.string(), pa.large_string())


def _type_problems(table: pa.Table) -> list[str]:
    """A line for every required column whose Arrow type is not the verl one (found vs expected)."""
    problems = []
    ds = table.schema.field("data_source").type
    if ds not in _STRING_TYPES:
        problems.append(f"column data_source has type {ds}, expected string")
    pt = table.schema.field("prompt").type
    ok = (pa.types.is_list(pt) or pa.types.is_large_list(pt)) and pa.types.is_struct(pt.value_type)
    if not ok or pt.value_type.get_field_index("content") < 0:
        problems.append(f"column prompt has type {pt}, expected list<struct<content: string, role: string>>")
    elif pt.value_type.field("content").type not in _STRING_TYPES:
        problems.append(
            f"column prompt.content has type {pt.value_type.field('content').type}, expected string"
        )
    rt = table.schema.field("reward_model").type
    if not pa.types.is_struct(rt) or rt.get_field_index("ground_truth") < 0:
        problems.append(
            f"column reward_model has type {rt}, expected struct<ground_truth: string, style: string>"
        )
    elif rt.field("ground_truth").type not in _STRING_TYPES:
        problems.append(
            f"column reward_model.ground_truth has type {rt.field('ground_truth').type}, expected string "
            "(write answers as text, e.g. '42')"
        )
    return problems


def _bad_utf8_rows(arr: pa.Array) -> np.ndarray:
    """Row indices of a string array whose bytes are not valid UTF-8 (Arrow does not check on read)."""
    try:
        arr.validate(full=True)
        return np.zeros(0, dtype=np.int64)
    except pa.ArrowInvalid:
        pass
    raw = arr.cast(pa.binary()).to_pylist() if not pa.types.is_binary(arr.type) else arr.to_pylist()
    bad = []
    for i, b in enumerate(raw):
        if b is None:
            continue
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            bad.append(i)
    return np.asarray(bad, dtype=np.int64)


def _flat(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array (row numbers then count from 0 over the whole column)."""
    if isinstance(arr, pa.ChunkedArray):
        return arr.combine_chunks() if arr.num_chunks else pa.array([], arr.type)
    return arr


def _missing_text(arr: pa.Array) -> np.ndarray:
    """True where a string is null, blank, or a missing value written as text ('nan', 'None', 'null')."""
    stripped = pc.utf8_lower(pc.utf8_trim_whitespace(arr.fill_null("")))
    bad = pc.is_in(stripped, value_set=pa.array(["", "nan", "none", "null"]))
    return np.asarray(bad.to_numpy(zero_copy_only=False), dtype=bool)


def dataset_row_problems(table: pa.Table) -> list[tuple[str, list[int], str]]:
    """(check, row numbers, what) for each failing row check of a dataset table with the verl column types:
    data_source missing, empty prompt (no message or only blank contents), missing/NaN ground truth,
    non-UTF-8 text."""
    out: list[tuple[str, list[int], str]] = []
    n = table.num_rows
    ds = _flat(table.column("data_source"))
    bad = np.flatnonzero(_missing_text(ds))
    if bad.size:
        out.append(("data_source", bad.tolist(), "data_source is missing or empty"))
    prompts = _flat(table.column("prompt"))
    contents = pc.struct_field(prompts.flatten(), "content")
    parents = np.asarray(pc.list_parent_indices(prompts).to_numpy(zero_copy_only=False), dtype=np.int64)
    filled = (
        ~np.asarray(
            pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(contents.fill_null(""))), 0).to_numpy(
                zero_copy_only=False
            ),
            dtype=bool,
        )
        if len(contents)
        else np.zeros(0, dtype=bool)
    )
    nonempty = np.bincount(parents[filled], minlength=n)[:n] if n else np.zeros(0, dtype=np.int64)
    bad = np.flatnonzero(nonempty == 0)
    if bad.size:
        out.append(("prompt", bad.tolist(), "the prompt is empty (no message, or only blank contents)"))
    bad_utf8 = np.unique(parents[_bad_utf8_rows(contents)]) if len(contents) else np.zeros(0, np.int64)
    if bad_utf8.size:
        out.append(("prompt.content", bad_utf8.tolist(), "the prompt holds bytes that are not UTF-8 text"))
    rm = _flat(table.column("reward_model"))
    gt = pc.struct_field(rm, "ground_truth")
    gt_missing = _missing_text(gt) | np.asarray(rm.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    bad = np.flatnonzero(gt_missing)
    if bad.size:
        out.append(("reward_model.ground_truth", bad.tolist(), "the ground truth is missing, empty or NaN"))
    for name, arr in (("data_source", ds), ("reward_model.ground_truth", gt)):
        rows = _bad_utf8_rows(arr)
        if rows.size:
            out.append((name, rows.tolist(), f"{name} holds bytes that are not UTF-8 text"))
    return out


def validate_dataset(table: pa.Table, *, name: str = "dataset") -> pa.Table:
    """Validate a dataset table in verl's schema (data_source, prompt messages, reward_model.ground_truth).

    Checks the column types first, then every row: empty prompts, missing / empty / NaN ground truths,
    missing data sources, non-UTF-8 text. Raises :class:`DatasetError` naming the file (`name`), the
    column, up to 5 offending row numbers (0-based) and the fix.
    """
    missing = [c for c in ("data_source", "prompt", "reward_model") if c not in table.column_names]
    if missing:
        raise DatasetError(
            f"{name}: missing column(s) {missing}; a verl/DAPO parquet needs data_source, prompt "
            f"(list of {{role, content}}), reward_model {{ground_truth, style}} (found {table.column_names}) "
            f"— {_DATASET_FIX}."
        )
    types = _type_problems(table)
    if types:
        raise DatasetError(f"{name}: wrong column type(s): " + "; ".join(types) + f" — {_DATASET_FIX}.")
    problems = dataset_row_problems(table)
    if problems:
        lines = [
            f"  {col}: {what} — rows {rows[:MAX_UIDS_IN_MESSAGE]}"
            + (f" (+{len(rows) - MAX_UIDS_IN_MESSAGE} more)" if len(rows) > MAX_UIDS_IN_MESSAGE else "")
            for col, rows, what in problems
        ]
        failures = [{"column": c, "what": w, "rows": r, "uids": []} for c, r, w in problems]
        raise DatasetError(
            f"{name}: invalid dataset rows (0-based row numbers) —\n"
            + "\n".join(lines)
            + f"\n  fix: {_DATASET_FIX}",
            failures,
        )
    return table
