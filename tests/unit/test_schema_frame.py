"""Stage validation through the compact per-row frame: pandera validates `row_ok`, Arrow types are compared
directly, and both kinds of failure come back in one paragraph naming each column; the step-anatomy medians
(`tests.helpers.step_anatomy`, which `bench/bench_step_anatomy.py` prints), loop / tail rows included."""

from __future__ import annotations

import pyarrow as pa
import pytest

from dapo_core.data import schemas as S
from tests.helpers import step_anatomy
from tests.unit.test_schemas import KW, LF32, replace, valid_table


def _err(stage: str, table: pa.Table) -> str:
    with pytest.raises(S.SchemaError) as e:
        S.validate_stage(stage, table, **KW)
    return str(e.value)


def test_pandera_schema_is_the_stage_contract_over_the_row_frame():
    schema, rcs = S._schema("advantage", frozenset(), 2, 50, 4, 5)
    assert schema.name == "dapo.advantage" and list(schema.columns) == [S.ROW_OK]
    assert {rc.column for rc in rcs} >= {"response_ids", "advantages", "response_mask", "uid"}
    schema.validate(pa.table({S.ROW_OK: pa.array([True, True])}))
    with pytest.raises(Exception, match="cross-field"):
        schema.validate(pa.table({S.ROW_OK: pa.array([True, False])}))


def test_extra_columns_pass_and_optional_columns_are_typed():
    t = valid_table("advantage").append_column("note", pa.array(["x"] * 4))
    S.validate_stage("advantage", t, **KW)  # columns outside the contract are carried along
    t = valid_table("advantage").append_column(
        "rollout_is_weights", pa.array([[1.0, 1.0, 1.0], [1.0], [1.0, 1.0], []], pa.list_(pa.float64()))
    )
    msg = _err("advantage", t)
    assert "column 'rollout_is_weights': wrong type list<item: double>, expected list<item: float>" in msg


def test_types_compare_as_pandera_did():
    """string/large_string and list/large_list are alike; a list's item name and nullability do not count."""
    t = valid_table("generate")
    ids = t.column("response_ids")
    for table in (
        replace(t, "uid", t.column("uid").cast(pa.large_string())),
        replace(t, "response_ids", ids.cast(pa.large_list(pa.int32()))),
        replace(t, "response_ids", ids.cast(pa.list_(pa.field("element", pa.int32(), nullable=False)))),
    ):
        S.validate_stage("generate", table, **KW)
    for col, typ in (("gen_step", pa.int32()), ("response_ids", pa.list_(pa.int64()))):
        assert f"column '{col}': wrong type" in _err("generate", replace(t, col, t.column(col).cast(typ)))
    assert "column 'uid': wrong type dictionary" in _err(
        "generate", replace(t, "uid", t.column("uid").dictionary_encode())
    )


def test_type_and_row_failures_in_one_paragraph():
    t = replace(valid_table("old_log_prob"), "weight_version", pa.array([0] * 4, pa.int32()))
    t = replace(t, "entropy", pa.array([[0.1, 0.2, 0.0], [-1.0], [0.5, 0.5], []], LF32))
    msg = _err("old_log_prob", t)
    assert msg.startswith("[old_log_prob] batch failed 2 schema check(s) (4 rows):")
    assert "column 'weight_version': wrong type int32, expected int64" in msg
    assert "column 'entropy': entropy not finite or negative in 1 row(s); uids: aa" in msg


def test_anatomy_loop_and_tail_rows():
    rows = [
        {"timing_s/step": 2.0, "timing_s/generate": 1.0, "timing_s/update_actor": 0.7, "_loop_s": 2.5},
        {"timing_s/step": 3.0, "timing_s/generate": 1.5, "timing_s/update_actor": 1.2, "_loop_s": 3.1},
        {"timing_s/step": 4.0, "timing_s/generate": 2.0, "timing_s/update_actor": 1.5},
    ]
    out = step_anatomy(rows)
    assert out["step"] == 3.0 and out["orchestration"] == pytest.approx(0.3)
    assert out["loop"] == pytest.approx(2.8) and out["tail"] == pytest.approx(0.3)
    assert "driver_cpu" not in out  # rows without the driver's CPU time
    rows[0]["_driver_cpu_s"], rows[1]["_driver_cpu_s"] = 0.08, 0.12
    assert step_anatomy(rows)["driver_cpu"] == pytest.approx(0.10)
