"""Tests for dapo_core.data.schemas: a valid batch passes every stage; each violation is named; the compact
per-row frame that pandera validates."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dapo_core.data import schemas as S
from tests.helpers import step_anatomy

LI32 = pa.list_(pa.int32())
LF32 = pa.list_(pa.float32())
KW = {"n": 2, "vocab_size": 50, "max_prompt_length": 4, "max_response_length": 5}
UIDS = ["aa", "aa", "bb", "bb"]


def valid_table(stage: str = "advantage") -> pa.Table:
    """A 2-prompt × n=2 batch valid for ``stage`` (columns up to that stage only)."""
    resp = [[1, 2, 3], [4], [5, 6], []]
    lp = [[-0.1, -0.2, 0.0], [-1.0], [-0.5, -0.5], []]
    cols = {
        "uid": pa.array(UIDS),
        "prompt_id": pa.array([0, 0, 1, 1], pa.int64()),
        "sample_idx": pa.array([0, 1, 0, 1], pa.int32()),
        "data_source": pa.array(["math_dapo"] * 4),
        "ground_truth": pa.array(["34"] * 4),
        "prompt_ids": pa.array([[1, 2], [1, 2], [3], [3]], LI32),
        "response_ids": pa.array(resp, LI32),
        "rollout_log_probs": pa.array(lp, LF32),
        "weight_version": pa.array([0] * 4, pa.int64()),
        "gen_step": pa.array([0] * 4, pa.int64()),
        "finish_reason": pa.array(["stop", "length", "stop", "stop"]),
        "score": pa.array([1.0, -1.0, 1.0, -1.0], pa.float32()),
        "acc": pa.array([True, False, True, False]),
        "pred": pa.array(["34", None, "34", "1"]),
        "overlong_reward": pa.array([0.0] * 4, pa.float32()),
        "reward": pa.array([1.0, -1.0, 1.0, -1.0], pa.float32()),
        "old_log_probs": pa.array(lp, LF32),
        "entropy": pa.array([[0.1, 0.2, 0.0], [1.0], [0.5, 0.5], []], LF32),
        "ref_log_probs": pa.array(lp, LF32),
        "values": pa.array([[0.5, 0.5, 0.5], [1.0], [0.0, 0.0], []], LF32),
        "token_level_rewards": pa.array([[0, 0, 1.0], [-1.0], [0, 1.0], []], LF32),
        "advantages": pa.array([[0.7, 0.7, 0.7], [-0.7], [0.7, 0.7], []], LF32),
        "returns": pa.array([[0.7, 0.7, 0.7], [-0.7], [0.7, 0.7], []], LF32),
        "response_mask": pa.array([[1, 1, 1], [1], [1, 0], []], pa.list_(pa.int8())),
    }
    keep = S.STAGE_COLUMNS[stage] + S.OPTIONAL_COLUMNS[stage]
    return pa.table({k: v for k, v in cols.items() if k in keep})


def replace(table: pa.Table, name: str, arr) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, arr)


@pytest.mark.parametrize("stage", S.STAGES)
def test_valid_batch_passes_every_stage(stage):
    t = valid_table(stage)
    assert S.validate_stage(stage, t, **KW) is t


def test_stage_columns_are_cumulative():
    assert S.STAGE_COLUMNS["generate"][-5:] == [
        "response_ids",
        "rollout_log_probs",
        "weight_version",
        "gen_step",
        "finish_reason",
    ]
    for a, b in zip(S.STAGES, S.STAGES[1:], strict=False):
        carried = set(S.STAGE_COLUMNS[a]) - {"ref_log_probs", "values", "old_log_probs", "entropy"}
        assert carried <= set(S.STAGE_COLUMNS[b]), (a, b)
    assert "ref_log_probs" in S.STAGE_COLUMNS["ref"]
    assert "values" in S.STAGE_COLUMNS["values"]
    assert "ref_log_probs" not in S.STAGE_COLUMNS["advantage"]  # DAPO runs without a ref model
    assert "rollout_is_weights" in S.OPTIONAL_COLUMNS["advantage"]


def test_missing_column_names_stage_and_column():
    t = valid_table("reward").drop_columns(["acc"])
    with pytest.raises(S.SchemaError, match=r"\[reward\].*'acc'"):
        S.validate_stage("reward", t, **KW)


def _err(stage, table, **over):
    kw = {**KW, **over}
    with pytest.raises(S.SchemaError) as ei:
        S.validate_stage(stage, table, **kw)
    return str(ei.value)


def test_length_mismatch_names_column_and_uid():
    t = valid_table("old_log_prob")
    t = replace(t, "old_log_probs", pa.array([[-0.1, -0.2, 0.0], [-1.0, -1.0], [-0.5, -0.5], []], LF32))
    msg = _err("old_log_prob", t)
    assert "[old_log_prob]" in msg and "column 'old_log_probs'" in msg
    assert "length differs" in msg and "uids: aa" in msg and "fix:" in msg


@pytest.mark.parametrize("bad", [0.01, float("nan"), float("inf"), -float("inf")])
def test_logprob_positive_or_not_finite(bad):
    t = valid_table("generate")
    t = replace(t, "rollout_log_probs", pa.array([[-0.1, -0.2, 0.0], [-1.0], [-0.5, bad], []], LF32))
    msg = _err("generate", t)
    assert "column 'rollout_log_probs'" in msg and "uids: bb" in msg


def test_logprob_tolerance_documented():
    t = valid_table("generate")
    ok = replace(t, "rollout_log_probs", pa.array([[-0.1, -0.2, 5e-7], [-1.0], [-0.5, -0.5], []], LF32))
    S.validate_stage("generate", ok, **KW)  # within LOGPROB_TOL = 1e-6


def test_rewards_and_advantages_finite():
    t = valid_table("advantage")
    t = replace(t, "reward", pa.array([1.0, float("nan"), 1.0, -1.0], pa.float32()))
    t = replace(t, "advantages", pa.array([[0.7, 0.7, 0.7], [-0.7], [0.7, float("inf")], []], LF32))
    msg = _err("advantage", t)
    assert "column 'reward'" in msg and "column 'advantages'" in msg
    assert "failed 2 schema check(s)" in msg  # lazy: both collected into one error


def test_group_size_and_sample_idx():
    t = valid_table("generate").slice(0, 3)  # group bb has one row
    msg = _err("generate", t)
    assert "n=2" in msg and "uids: bb" in msg
    S.validate_stage("generate", t, **{**KW, "n": None})  # n=None skips the group check
    t2 = replace(valid_table("generate"), "sample_idx", pa.array([0, 1, 0, 2], pa.int32()))
    assert "column 'sample_idx'" in _err("generate", t2)


def test_token_ids_and_lengths():
    t = valid_table("generate")
    t = replace(t, "response_ids", pa.array([[1, 2, 50], [4], [5, -1], []], LI32))
    msg = _err("generate", t)
    assert "column 'response_ids': token id outside [0, 50)" in msg and "uids: aa, bb" in msg
    t = valid_table("generate")
    msg = _err("generate", t, max_response_length=2, max_prompt_length=1)
    assert "max_response_length=2" in msg and "max_prompt_length=1" in msg


def test_dtype_null_and_finish_reason():
    t = valid_table("reward")
    t = replace(t, "score", pa.array([1.0, -1.0, 1.0, -1.0], pa.float64()))
    t = replace(t, "finish_reason", pa.array(["stop", None, "eos", "stop"]))
    msg = _err("reward", t)
    assert "column 'score': wrong type double, expected float" in msg and "cast 'score'" in msg
    assert "column 'finish_reason': null values" in msg and "uids: aa" in msg
    assert "finish_reason not 'stop' or 'length'" in msg and "bb" in msg
    # pred may be null
    S.validate_stage("reward", valid_table("reward"), **KW)


def test_response_mask_and_is_weights():
    t = valid_table("advantage")
    t = replace(t, "response_mask", pa.array([[1, 1, 2], [1], [1, 0], []], pa.list_(pa.int8())))
    assert "mask value not 0/1" in _err("advantage", t)
    t = valid_table("advantage").append_column(
        "rollout_is_weights", pa.array([[1.0, 1.0, 1.0], [-0.5], [1.0, 1.0], []], LF32)
    )
    msg = _err("advantage", t)
    assert "column 'rollout_is_weights'" in msg and "uids: aa" in msg


def test_uid_limit_in_message():
    n = 8
    rows = n * 2
    uids = [f"u{i}" for i in range(n) for _ in range(2)]
    t = valid_table("generate")
    big = pa.table(
        {c: pa.array([t.column(c)[0].as_py()] * rows, t.schema.field(c).type) for c in t.column_names}
    )
    big = replace(big, "uid", pa.array(uids))
    big = replace(big, "sample_idx", pa.array([0, 1] * n, pa.int32()))
    big = replace(big, "rollout_log_probs", pa.array([[0.5, 0, 0]] * rows, LF32))
    msg = _err("generate", big)
    line = next(ln for ln in msg.splitlines() if "rollout_log_probs" in ln and "log-prob" in ln)
    assert "in 16 row(s)" in line
    assert "u0, u1, u2, u3, u4…" in line and "u5" not in line


def test_unknown_stage():
    with pytest.raises(ValueError, match="unknown stage"):
        S.validate_stage("rewards", valid_table("reward"), **KW)


def test_vectorised_on_chunked_table():
    t = valid_table("advantage")
    chunked = pa.concat_tables([t.slice(0, 2), t.slice(2, 2)])
    assert chunked.column("uid").num_chunks == 2
    S.validate_stage("advantage", chunked, **KW)
    bad = replace(
        chunked,
        "values",
        pa.chunked_array([pa.array([[0.5, 0.5, 0.5], [1.0]], LF32), pa.array([[0.0, np.nan], []], LF32)]),
    )
    assert "uids: bb" in _err("advantage", bad)


def test_wrong_type_does_not_crash_the_checks():
    t = replace(valid_table("generate"), "uid", pa.array([1, 1, 2, 2], pa.int64()))
    msg = _err("generate", t)
    assert "column 'uid': wrong type int64" in msg


# ----------------------------------------------------------------------------------------------------------
# Stage validation through the compact per-row frame: pandera validates `row_ok`, Arrow types are compared
# directly, and both kinds of failure come back in one paragraph naming each column; the step-anatomy medians
# (`tests.helpers.step_anatomy`, which `bench/bench_step_anatomy.py` prints), loop / tail rows included.


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
