"""`dapo prepare` on DAPO-Math-style files (local paths here; URLs go through fsspec): duplicates are counted,
dropped only with data.dedup=true, and the written files pass the dataset schema."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from dapo_core.config import load_config, to_yaml
from dapo_core.data.datasets import make_synthetic_math, write_parquet
from tests.integration.conftest import CONFIG


@pytest.mark.parametrize("dedup", [False, True])
def test_prepare_counts_and_optionally_drops_duplicates(tmp_path, prefect_home, dedup):
    from flows.prepare_data import prepare_data_flow

    rows = make_synthetic_math(10, min_value=0, max_value=50, num_operands=2, ops=["+"], seed=4)
    for r in rows:
        r["data_source"] = "math_dapo"
    write_parquet(rows * 5, tmp_path / "dapo-math-17k.parquet")  # each problem 5x, like DAPO-Math-17k's 100x
    write_parquet(rows[:3] * 4, tmp_path / "aime-2024.parquet")
    cfg = load_config(
        CONFIG,
        [
            "data.synthetic.enable=false",
            f"data.synthetic.out_dir={tmp_path / 'out'}",
            f"data.dedup={str(dedup).lower()}",
            f"data.source_files.train={tmp_path / 'dapo-math-17k.parquet'}",
            f"data.source_files.val={tmp_path / 'aime-2024.parquet'}",
        ],
    )
    stats = prepare_data_flow(to_yaml(cfg))
    assert (
        stats["train"]["rows"] == 50 and stats["train"]["unique"] == 10 and stats["train"]["duplicates"] == 40
    )
    assert stats["val"]["unique"] == 3 and stats["val"]["duplicates"] == 9
    written = pq.read_table(tmp_path / "out" / "dapo-math-17k.parquet")
    assert written.num_rows == (10 if dedup else 50)
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["train"]["duplicates"] == 40
