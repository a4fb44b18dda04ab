"""Rows of the bad-input table: data files, and data that is there but empty or gone."""

from __future__ import annotations

from tests.unit.bad_inputs.workspace import (
    Case,
    _column,
    _dangling_data,
    _drop_column,
    _no_rows,
    _non_utf8_prompt,
    _rows,
    _set,
    _set_gt,
    _train,
    _truncate,
    _write,
)

DATA: list[Case] = [
    # --- data files (read by training: checked before any worker starts)
    Case(
        "train file missing",
        "data",
        _train(),
        ("train.parquet", "does not exist", "dapo prepare"),
        "PreflightError",
        setup=lambda ws: ws.train.unlink(),
    ),
    Case(
        "train file is a folder",
        "data",
        lambda ws: [*_train()(ws), f"data.train_files=[{ws.root}]"],
        ("is a folder", "data.train_files"),
    ),
    Case(
        "random bytes .parquet",
        "data",
        _train(),
        ("train.parquet", "not a readable parquet", "dapo prepare"),
        setup=_write(lambda ws: ws.train, bytes(range(256)) * 4),
    ),
    Case(
        "CSV named .parquet",
        "data",
        _train(),
        ("train.parquet", "not a readable parquet"),
        setup=_write(lambda ws: ws.train, b"data_source,prompt\nx,y\n"),
    ),
    Case(
        "empty .parquet",
        "data",
        _train(),
        ("train.parquet", "not a readable parquet"),
        setup=_write(lambda ws: ws.train, b""),
    ),
    Case(
        "truncated .parquet",
        "data",
        _train(),
        ("train.parquet", "not a readable parquet"),
        setup=_truncate(lambda ws: ws.train, 0.5),
    ),
    Case(
        "column prompt missing",
        "data",
        _train(),
        ("train.parquet", "prompt"),
        setup=_drop_column("prompt"),
    ),
    Case(
        "column reward_model missing",
        "data",
        _train(),
        ("train.parquet", "reward_model"),
        setup=_drop_column("reward_model"),
    ),
    Case(
        "prompt is a string column",
        "data",
        _train(),
        ("train.parquet", "prompt has type string", "dapo prepare"),
        setup=_column("prompt", lambda n: ["2+2=?"] * n),
    ),
    Case(
        "reward_model is a string column",
        "data",
        _train(),
        ("train.parquet", "reward_model has type"),
        setup=_column("reward_model", lambda n: ["4"] * n),
    ),
    Case(
        "ground_truth is an int",
        "data",
        _train(),
        ("reward_model.ground_truth has type int64", "as text"),
        setup=_column("reward_model", lambda n: [{"ground_truth": 4, "style": "rule"}] * n),
    ),
    Case(
        "data_source is an int",
        "data",
        _train(),
        ("data_source has type int64",),
        setup=_column("data_source", lambda n: [1] * n),
    ),
    Case(
        "empty prompt list",
        "data",
        _train(),
        ("train.parquet", "prompt is empty", "rows [3]", "repair or drop"),
        setup=_rows(_set(3, "prompt", [])),
    ),
    Case(
        "blank prompt text",
        "data",
        _train(),
        ("prompt is empty", "rows [5]"),
        setup=_rows(_set(5, "prompt", [{"role": "user", "content": "   "}])),
    ),
    Case(
        "ground truth null",
        "data",
        _train(),
        ("ground truth is missing", "rows [2]"),
        setup=_rows(_set_gt(2, None)),
    ),
    Case(
        "ground truth 'nan'",
        "data",
        _train(),
        ("ground truth is missing, empty or NaN", "rows [4]"),
        setup=_rows(_set_gt(4, "nan")),
    ),
    Case(
        "ground truth empty",
        "data",
        _train(),
        ("ground truth", "rows [0]"),
        setup=_rows(_set_gt(0, "")),
    ),
    Case(
        "non-UTF-8 prompt bytes",
        "data",
        _train(),
        ("train.parquet", "not UTF-8"),
        setup=_non_utf8_prompt,
    ),
    Case(
        "unknown data_source",
        "data",
        _train(),
        ("row 6", "data_source 'gsm8k'", "no reward function"),
        setup=_rows(_set(6, "data_source", "gsm8k")),
    ),
    Case(
        "data_source empty",
        "data",
        _train(),
        ("data_source is missing", "rows [1]"),
        setup=_rows(_set(1, "data_source", "")),
    ),
    Case(
        "bad row in the val file",
        "data",
        _train(),
        ("val.parquet", "data.val_files", "rows [0]"),
        setup=_rows(_set_gt(0, None), which="val"),
    ),
]


EMPTY_DATA: list[Case] = [
    # --- data that is there but empty or gone
    Case(
        "train file with zero rows",
        "data",
        _train(),
        ("train.parquet has the right columns but no rows", "data.train_files"),
        "PreflightError",
        setup=_no_rows("train"),
    ),
    Case(
        "val file with zero rows",
        "data",
        _train(),
        ("val.parquet has the right columns but no rows", "data.val_files"),
        "PreflightError",
        setup=_no_rows("val"),
    ),
    Case(
        "train file a dangling symlink (data moved)",
        "data",
        _train(),
        ("train.parquet does not exist", "data.train_files"),
        "PreflightError",
        setup=_dangling_data,
    ),
]
