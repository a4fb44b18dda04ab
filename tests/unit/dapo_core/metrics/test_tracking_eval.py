"""Metric logging backends, the end-of-run plot, and the validation summary (pass@k, answer-line rate)."""

from __future__ import annotations

import math
import re

import pyarrow as pa
import pytest

from dapo_core.metrics.tracking import Tracker, plot_run, read_jsonl
from dapo_core.metrics.validation import answer_line_rate_by_source, pass_at_k_by_source, validation_summary


def test_tracker_writes_jsonl_tensorboard_and_console(tmp_path):
    lines = []
    tr = Tracker(tmp_path, ["console", "jsonl", "tensorboard"], printer=lines.append)
    tr.log(
        1, {"critic/score/mean": -0.5, "actor/entropy": 0.2, "note": "text is skipped", "nan": float("nan")}
    )
    tr.log(2, {"critic/score/mean": 0.1})
    tr.log(2, {"critic/score/mean": 0.3, "val-core/s/acc/mean@1": 0.4})  # a resumed run logs step 2 again
    tr.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["critic/score/mean"] == 0.3 and rows[1]["val-core/s/acc/mean@1"] == 0.4
    assert "note" not in rows[0] and math.isnan(rows[0]["nan"])
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert lines[0].startswith("[step 1]") and "critic/score/mean=-0.5" in lines[0]
    png = plot_run(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_logger_is_named():
    with pytest.raises(ValueError, match=re.escape("trainer.logger: unknown backend 'wandb'")):
        Tracker("/tmp/x", ["wandb"])


def test_pass_at_k_and_answer_line_rate_by_hand():
    # prompt u1: 1 of 4 correct; prompt u2: 2 of 4 correct
    sources = ["s"] * 8
    uids = ["u1"] * 4 + ["u2"] * 4
    acc = [1, 0, 0, 0, 1, 1, 0, 0]
    out = pass_at_k_by_source(sources, uids, [float(a) for a in acc])
    assert out["val-core/s/acc/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    # pass@2 = 1 - C(n-c,2)/C(n,2): u1 1 - 3/6 = 0.5, u2 1 - 1/6
    assert out["val-core/s/acc/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert out["val-core/s/acc/pass@4"] == pytest.approx(1.0)
    rate = answer_line_rate_by_source(sources, ["3", "[INVALID]", None, "4", "5", "5", "[INVALID]", "1"])
    assert rate == {"val-aux/s/format/answer_line_rate": pytest.approx(5 / 8)}


def test_validation_summary_has_core_keys():
    t = pa.table(
        {
            "uid": ["a", "a", "b", "b"],
            "data_source": ["s"] * 4,
            "acc": [True, False, True, True],
            "reward": [1.0, -1.0, 1.0, 1.0],
            "pred": ["1", "2", "3", "3"],
        }
    )
    m = validation_summary(t)
    assert m["val-core/s/acc/mean@2"] == pytest.approx(0.75)
    assert m["val-core/s/acc/pass@2"] == pytest.approx(1.0)
    assert any(k.startswith("val-core/s/acc/maj@2") for k in m)
