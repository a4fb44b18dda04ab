"""Pandera schemas of the pipeline's stage files: the batch at every stage boundary, checked vectorised.

One schema per stage output (``generate``, ``reward``, ``old_log_prob``, ``ref``, ``values``, ``advantage``),
cumulative (each adds its new columns to those of the stages before it); ``ref_log_probs``, ``values`` and
``rollout_is_weights`` are checked where present. Columns and Arrow types are compared with ``pyarrow``
against ``COLUMN_TYPES``; the row predicates (per-token list lengths, finite log-probs ≤ ``LOGPROB_TOL``, mask
values, token id and length bounds, ``n`` rows per ``uid``) run vectorised with ``pyarrow.compute`` + numpy,
and pandera validates the compact per-row frame of their outcome (``row_ok``). :func:`validate_stage` runs
every check and raises one :class:`SchemaError` naming the stage, each failing column, up to 5 uids and the
fix; docs/ARCHITECTURE.md lists each predicate. A user's dataset file: :mod:`dapo_core.data.dataset_checks`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if importlib.util.find_spec("pyspark") is None:
    # pandera 0.35's narwhals backend tries `from pandera.engines import pyspark_engine` in every column's
    # dtype check; without pyspark that import fails, is not cached and re-executes the module each time.
    # Marking the module absent makes the import fail at once, as it would anyway.
    sys.modules.setdefault("pandera.engines.pyspark_engine", None)  # type: ignore[arg-type]

import pandera.errors as pa_errors
import pandera.pyarrow as ppa
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from pandera.api.pyarrow.types import PyArrowData

__all__ = [
    "COLUMN_TYPES",
    "LOGPROB_TOL",
    "MAX_UIDS_IN_MESSAGE",
    "OPTIONAL_COLUMNS",
    "STAGES",
    "STAGE_COLUMNS",
    "SchemaError",
    "validate_stage",
]

LOGPROB_TOL = 1e-6
"""Log-probs may exceed 0 by at most this much (float rounding of a probability-1 token)."""

MAX_UIDS_IN_MESSAGE = 5
"""How many offending uids an error message lists per failed check."""

STAGES = ("generate", "reward", "old_log_prob", "ref", "values", "advantage")
"""Stage names in pipeline order."""

LI32 = pa.list_(pa.int32())
LF32 = pa.list_(pa.float32())

COLUMN_TYPES: dict[str, pa.DataType] = {
    "uid": pa.string(),
    "prompt_id": pa.int64(),
    "sample_idx": pa.int32(),
    "data_source": pa.string(),
    "ground_truth": pa.string(),
    "prompt_ids": LI32,
    "response_ids": LI32,
    "rollout_log_probs": LF32,
    "weight_version": pa.int64(),
    "gen_step": pa.int64(),
    "finish_reason": pa.string(),
    "score": pa.float32(),
    "acc": pa.bool_(),
    "pred": pa.string(),
    "overlong_reward": pa.float32(),
    "reward": pa.float32(),
    "old_log_probs": LF32,
    "entropy": LF32,
    "ref_log_probs": LF32,
    "values": LF32,
    "token_level_rewards": LF32,
    "advantages": LF32,
    "returns": LF32,
    "response_mask": pa.list_(pa.int8()),
    "rollout_is_weights": LF32,
}
"""Arrow type of every contract column (docs/ARCHITECTURE.md, The batch contract)."""

NULLABLE = frozenset({"pred"})

_BASE = ["uid", "prompt_id", "sample_idx", "data_source", "ground_truth", "prompt_ids"]
_NEW: dict[str, list[str]] = {
    "generate": ["response_ids", "rollout_log_probs", "weight_version", "gen_step", "finish_reason"],
    "reward": ["score", "acc", "pred", "overlong_reward", "reward"],
    "old_log_prob": ["old_log_probs", "entropy"],
    "ref": ["ref_log_probs"],
    "values": ["values"],
    "advantage": ["token_level_rewards", "advantages", "returns", "response_mask"],
}
_CONDITIONAL = {
    "ref_log_probs": "ref",
    "values": "values",
    "old_log_probs": "old_log_prob",  # absent later when the flow skips the stage (on-policy or bypass mode)
    "entropy": "old_log_prob",
}


def _required(stage: str) -> list[str]:
    cols = list(_BASE)
    for s in STAGES[: STAGES.index(stage) + 1]:
        for c in _NEW[s]:
            if c in _CONDITIONAL and _CONDITIONAL[c] != stage:
                continue
            cols.append(c)
    return cols


STAGE_COLUMNS: dict[str, list[str]] = {s: _required(s) for s in STAGES}
"""Columns each stage's output must have (cumulative)."""


def _optional(stage: str) -> list[str]:
    i = STAGES.index(stage)
    out = [c for c, s in _CONDITIONAL.items() if i > STAGES.index(s)]
    if stage == "advantage":
        out.append("rollout_is_weights")
    return out


OPTIONAL_COLUMNS: dict[str, list[str]] = {s: _optional(s) for s in STAGES}
"""Columns validated when present (conditional stages / features)."""


class SchemaError(ValueError):
    """A stage's output broke the batch contract; the message names stage, columns, uids and the fix."""

    def __init__(self, message: str, failures: list[dict] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or []


# --------------------------------------------------------------------------------------------------
# vectorised row predicates (return a numpy bool array: True = row OK)


def _list(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _lengths(arr: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)


def _rows_all(arr: pa.Array, elem_ok: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Per row: do all its list elements satisfy ``elem_ok`` (vectorised on the flat values)?"""
    ok = np.ones(len(arr), dtype=bool)
    values = arr.flatten().to_numpy(zero_copy_only=False)
    if values.size == 0:
        return ok
    bad = ~elem_ok(values)
    if bad.any():
        parent = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
        ok[parent[bad]] = False
    return ok


def _len_matches(col: str) -> Callable[[pa.Table], np.ndarray]:
    def fn(table: pa.Table) -> np.ndarray:
        return _lengths(_list(table, col)) == _lengths(_list(table, "response_ids"))

    return fn


def _finite(col: str, lo: float = -np.inf, hi: float = np.inf) -> Callable[[pa.Table], np.ndarray]:
    def elem(v: np.ndarray) -> np.ndarray:
        return np.isfinite(v) & (v >= lo) & (v <= hi)

    def fn(table: pa.Table) -> np.ndarray:
        arr = _list(table, col)
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            return _rows_all(arr, elem)
        v = pc.fill_null(arr, np.nan).to_numpy(zero_copy_only=False).astype(np.float64)
        return elem(v)

    return fn


def _ids_in_vocab(col: str, vocab_size: int) -> Callable[[pa.Table], np.ndarray]:
    return lambda table: _rows_all(_list(table, col), lambda v: (v >= 0) & (v < vocab_size))


def _len_at_most(col: str, limit: int) -> Callable[[pa.Table], np.ndarray]:
    return lambda table: _lengths(_list(table, col)) <= limit


def _mask_binary(table: pa.Table) -> np.ndarray:
    return _rows_all(_list(table, "response_mask"), lambda v: (v == 0) | (v == 1))


def _group_size(n: int) -> Callable[[pa.Table], np.ndarray]:
    def fn(table: pa.Table) -> np.ndarray:
        uid = table.column("uid")
        vc = pc.value_counts(uid)
        wrong = vc.field("values").filter(pc.not_equal(vc.field("counts"), n))
        if len(wrong) == 0:
            return np.ones(table.num_rows, dtype=bool)
        return ~pc.is_in(uid, value_set=wrong).to_numpy(zero_copy_only=False)

    return fn


def _sample_idx_range(n: int) -> Callable[[pa.Table], np.ndarray]:
    def fn(table: pa.Table) -> np.ndarray:
        v = pc.fill_null(table.column("sample_idx"), -1).to_numpy()
        return (v >= 0) & (v < n)

    return fn


def _finish_reason_ok(table: pa.Table) -> np.ndarray:
    ok = pc.is_in(table.column("finish_reason"), value_set=pa.array(["stop", "length"]))
    return pc.fill_null(ok, False).to_numpy(zero_copy_only=False)


def _uid_format(table: pa.Table) -> np.ndarray:
    uid = table.column("uid")
    ok = pc.and_(pc.greater(pc.utf8_length(uid), 0), pc.invert(pc.match_substring(uid, "_")))
    return pc.fill_null(ok, False).to_numpy(zero_copy_only=False)


# --------------------------------------------------------------------------------------------------
# schema construction


@dataclass(frozen=True)
class _RowCheck:
    column: str
    what: str
    hint: str
    fn: Callable[[pa.Table], np.ndarray]


def _row_checks(
    stage: str, present: frozenset[str], n: int | None, vocab_size: int, max_p: int, max_r: int
) -> list[_RowCheck]:
    cols = set(STAGE_COLUMNS[stage]) | (set(OPTIONAL_COLUMNS[stage]) & present)
    checks = [
        _RowCheck("uid", "uid is empty or contains '_'", "use uuid4().hex per sampled prompt", _uid_format),
        _RowCheck(
            "prompt_ids",
            f"token id outside [0, {vocab_size})",
            "tokenize with the model's tokenizer / check vocab_size",
            _ids_in_vocab("prompt_ids", vocab_size),
        ),
        _RowCheck(
            "prompt_ids",
            f"prompt longer than max_prompt_length={max_p}",
            "filter or truncate prompts in data prep (data.max_prompt_length)",
            _len_at_most("prompt_ids", max_p),
        ),
    ]
    if n is not None:
        checks.append(
            _RowCheck(
                "uid",
                f"uid group does not have exactly n={n} rows",
                "keep or drop whole groups (filter_groups) and repeat each prompt n times",
                _group_size(n),
            )
        )
        checks.append(
            _RowCheck(
                "sample_idx",
                f"sample_idx outside [0, {n})",
                "number the samples of a prompt 0..n-1",
                _sample_idx_range(n),
            )
        )
    if "finish_reason" in cols:
        checks.append(
            _RowCheck(
                "finish_reason",
                "finish_reason not 'stop' or 'length'",
                "map the engine's stop reason to 'stop' (EOS/stop string) or 'length'",
                _finish_reason_ok,
            )
        )
    if "response_ids" in cols:
        checks.append(
            _RowCheck(
                "response_ids",
                f"token id outside [0, {vocab_size})",
                "check the engine's vocab / tokenizer pairing",
                _ids_in_vocab("response_ids", vocab_size),
            )
        )
        checks.append(
            _RowCheck(
                "response_ids",
                f"response longer than max_response_length={max_r}",
                "pass max_new_tokens=data.max_response_length to the engine",
                _len_at_most("response_ids", max_r),
            )
        )
    logprob_cols = {"rollout_log_probs", "old_log_probs", "ref_log_probs"}
    per_token = [
        "rollout_log_probs",
        "old_log_probs",
        "entropy",
        "ref_log_probs",
        "values",
        "token_level_rewards",
        "advantages",
        "returns",
        "response_mask",
        "rollout_is_weights",
    ]
    for c in per_token:
        if c not in cols:
            continue
        checks.append(
            _RowCheck(
                c,
                "list length differs from response_ids",
                "compute it over exactly the response tokens of each row",
                _len_matches(c),
            )
        )
        if c in logprob_cols:
            checks.append(
                _RowCheck(
                    c,
                    f"log-prob not finite or > {LOGPROB_TOL}",
                    "take log_softmax in float32 and gather the sampled tokens",
                    _finite(c, hi=LOGPROB_TOL),
                )
            )
        elif c == "entropy":
            checks.append(
                _RowCheck(
                    c,
                    "entropy not finite or negative",
                    "compute entropy from float32 logits",
                    _finite(c, lo=-LOGPROB_TOL),
                )
            )
        elif c == "response_mask":
            checks.append(_RowCheck(c, "mask value not 0/1", "store the mask as 0/1 int8", _mask_binary))
        elif c == "rollout_is_weights":
            checks.append(
                _RowCheck(
                    c,
                    "IS weight not finite or negative",
                    "check rollout_is_threshold / log-ratio clamping",
                    _finite(c, lo=0.0),
                )
            )
        else:
            checks.append(
                _RowCheck(
                    c,
                    "value not finite (NaN/inf)",
                    "look for division by zero / overflow upstream",
                    _finite(c),
                )
            )
    for c in ("score", "overlong_reward", "reward"):
        if c in cols:
            checks.append(
                _RowCheck(
                    c,
                    "value not finite (NaN/inf)",
                    "make the reward function return a finite float",
                    _finite(c),
                )
            )
    return checks


def _stage_cols(stage: str, present: frozenset[str]) -> list[str]:
    return list(STAGE_COLUMNS[stage]) + [c for c in OPTIONAL_COLUMNS[stage] if c in present]


def _not_null(col: str) -> Callable[[pa.Table], np.ndarray]:
    def fn(table: pa.Table) -> np.ndarray:
        c = table.column(col)
        if c.null_count == 0:  # Arrow keeps the count: no pass over the data
            return np.ones(table.num_rows, dtype=bool)
        return ~pc.is_null(c).to_numpy(zero_copy_only=False)

    return fn


ROW_OK = "row_ok"
"""Column of the compact per-row frame pandera validates: True when every row predicate holds for the row."""


def _all_true(data: PyArrowData) -> pa.Array:
    return pc.fill_null(data.table.column(ROW_OK), False)


@lru_cache(maxsize=256)
def _schema(
    stage: str, present: frozenset[str], n: int | None, vocab_size: int, max_p: int, max_r: int
) -> tuple[ppa.DataFrameSchema, tuple[_RowCheck, ...]]:
    """The pandera schema of `stage` over the compact per-row frame (`ROW_OK`), and the row predicates that
    frame is computed from: nulls (O(1) via Arrow's null count) and every cross-field predicate, AND-ed.
    On failure every predicate is re-run separately to name each failing column (only the failure path
    pays for that)."""
    null_checks = [
        _RowCheck(
            c,
            "null values",
            f"fill '{c}' in every row (nulls are only allowed in {sorted(NULLABLE)})",
            _not_null(c),
        )
        for c in _stage_cols(stage, present)
        if c not in NULLABLE
    ]
    rcs = tuple(null_checks + _row_checks(stage, present, n, vocab_size, max_p, max_r))
    schema = ppa.DataFrameSchema(
        {ROW_OK: ppa.Column(pa.bool_(), nullable=False, required=True)},
        checks=[ppa.Check(_all_true, name="cross_field", error="cross-field row checks")],
        strict=True,
        name=f"dapo.{stage}",
    )
    return schema, rcs


def _type_key(t: pa.DataType) -> object:
    """What a column type is compared by — as pandera's narwhals backend did: string and large_string alike,
    list and large_list alike, a list's item field name and nullability ignored."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return ("list", _type_key(t.value_type))
    return t


def _type_failures(stage: str, present: frozenset[str], table: pa.Table) -> list[dict]:
    """A failure for every stage column whose Arrow type is not `COLUMN_TYPES`' (found vs expected)."""
    out: list[dict] = []
    for c in _stage_cols(stage, present):
        actual, expected = table.schema.field(c).type, COLUMN_TYPES[c]
        if _type_key(actual) != _type_key(expected):
            out.append(
                {
                    "column": c,
                    "what": f"wrong type {actual}, expected {expected}",
                    "hint": f"cast '{c}' to {expected} when building the table",
                    "rows": None,
                    "uids": [],
                }
            )
    return out


def _row_ok(rcs: tuple[_RowCheck, ...], table: pa.Table) -> np.ndarray | None:
    """The AND of every row predicate, or None when one cannot run (e.g. on a column of the wrong type)."""
    ok = np.ones(table.num_rows, dtype=bool)
    try:
        for rc in rcs:
            ok &= rc.fn(table)
    except Exception:  # _explain_rows reports which predicate could not run
        return None
    return ok


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {list(STAGES)}")


# --------------------------------------------------------------------------------------------------
# validation


def _uids_of(failure_cases: pa.Table | None) -> list[str]:
    if failure_cases is None or not isinstance(failure_cases, pa.Table):
        return []
    if "uid" not in failure_cases.column_names:
        return []
    seen: list[str] = []
    for u in failure_cases.column("uid").to_pylist():
        if u is not None and u not in seen:
            seen.append(str(u))
        if len(seen) > MAX_UIDS_IN_MESSAGE:
            break
    return seen


def validate_stage(
    stage: str,
    table: pa.Table,
    *,
    n: int | None,
    vocab_size: int,
    max_prompt_length: int,
    max_response_length: int,
) -> pa.Table:
    """Validate ``table`` as the output of ``stage`` and return it unchanged.

    Runs every check (lazy validation) and raises one :class:`SchemaError` naming the stage, each
    failing column, the number of bad rows, up to 5 offending uids and a hint of what to fix.
    ``n=None`` skips the group-size and ``sample_idx`` checks (e.g. validation batches).
    """
    _check_stage(stage)
    if not isinstance(table, pa.Table):
        raise SchemaError(f"[{stage}] expected a pyarrow.Table, got {type(table).__name__}")
    present = frozenset(table.column_names) & frozenset(OPTIONAL_COLUMNS[stage])
    missing = [c for c in STAGE_COLUMNS[stage] if c not in table.column_names]
    if missing:
        raise SchemaError(
            f"[{stage}] missing column(s) {missing}: the '{stage}' output must carry "
            f"{STAGE_COLUMNS[stage]}; run the earlier stages / add the stage's outputs before committing",
            [{"column": c, "what": "missing"} for c in missing],
        )
    schema, rcs = _schema(stage, present, n, vocab_size, max_prompt_length, max_response_length)
    failures = _type_failures(stage, present, table)
    ok = _row_ok(rcs, table)
    if ok is None:
        failures += _explain_rows(rcs, table)
    else:
        try:
            schema.validate(pa.table({ROW_OK: pa.array(ok, pa.bool_())}), lazy=True)
        except pa_errors.SchemaErrors as errs:
            failures += _collect(errs, table)
            if any(
                getattr(getattr(e, "check", None), "name", None) == "cross_field" for e in errs.schema_errors
            ):
                failures += _explain_rows(rcs, table)
        except pa_errors.SchemaError as err:  # pragma: no cover - lazy=True always groups errors
            failures.append(
                {"column": "?", "what": str(err), "uids": [], "rows": None, "hint": "see pandera message"}
            )
    if not failures:
        return table
    lines = [f"[{stage}] batch failed {len(failures)} schema check(s) ({table.num_rows} rows):"]
    for f in failures:
        uids = f["uids"]
        more = "…" if len(uids) > MAX_UIDS_IN_MESSAGE else ""
        rows = f" in {f['rows']} row(s)" if f["rows"] is not None else ""
        uid_txt = f"; uids: {', '.join(uids[:MAX_UIDS_IN_MESSAGE])}{more}" if uids else ""
        lines.append(f"  - column '{f['column']}': {f['what']}{rows}{uid_txt}; fix: {f['hint']}")
    raise SchemaError("\n".join(lines), failures)


def _explain_rows(rcs: tuple[_RowCheck, ...], table: pa.Table) -> list[dict]:
    """Re-run each row predicate and describe the ones that fail (failure path only)."""
    out: list[dict] = []
    for rc in rcs:
        try:
            ok = rc.fn(table)
        except Exception as exc:  # a predicate crashing on bad data is itself a finding
            out.append(
                {
                    "column": rc.column,
                    "what": f"check '{rc.what}' could not run ({exc})",
                    "hint": rc.hint,
                    "rows": None,
                    "uids": [],
                }
            )
            continue
        if ok.all():
            continue
        bad = table.filter(pa.array(~ok)).select(["uid"]) if "uid" in table.column_names else None
        out.append(
            {
                "column": rc.column,
                "what": rc.what,
                "hint": rc.hint,
                "rows": int((~ok).sum()),
                "uids": _uids_of(bad),
            }
        )
    return out


def _collect(errs: pa_errors.SchemaErrors, table: pa.Table) -> list[dict]:
    """Describe pandera's failures on the compact frame other than the cross-field check (which
    `_explain_rows` details per column); the frame is built here, so these only show a bug of ours."""
    failures: list[dict] = []
    for err in errs.schema_errors:
        if getattr(getattr(err, "check", None), "name", None) == "cross_field":
            continue  # detailed by _explain_rows
        column = getattr(getattr(err, "schema", None), "name", None) or "?"
        reason = getattr(err, "reason_code", None)
        reason_txt = getattr(reason, "name", str(reason)).lower()
        if "dtype" in reason_txt or "datatype" in reason_txt:
            actual = table.schema.field(column).type if column in table.column_names else "?"
            what = f"wrong type {actual}, expected {COLUMN_TYPES.get(column)}"
            hint = f"cast '{column}' to {COLUMN_TYPES.get(column)} when building the table"
        else:
            what = str(err).splitlines()[0]
            hint = "see the batch contract in docs/ARCHITECTURE.md"
        failures.append({"column": column, "what": what, "hint": hint, "rows": None, "uids": []})
    return failures
