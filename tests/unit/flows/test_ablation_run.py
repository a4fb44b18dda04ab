"""What `dapo ablate` reads of a lineage: its params file, experiment stages, metric files, budget and the
stages to run first; and the refusals of a lineage it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.ablation import ExpRecord
from flows.ablation_run import AblationError, pending, read_lineage, upstream_stages

ROOT = Path(__file__).resolve().parents[3]


def test_the_real_model_lineage():
    lin = read_lineage(ROOT, "pipelines/smollm2/dvc.yaml")
    assert lin.params_file == "pipelines/smollm2/params.yaml"
    assert lin.stages == ("pipelines/smollm2/dvc.yaml:train", "pipelines/smollm2/dvc.yaml:evaluate")
    assert lin.metrics.train == "metrics/smollm2/train.json"
    assert lin.metrics.sampled == "metrics/smollm2/eval.json"
    assert lin.metrics.greedy == "metrics/smollm2/eval_greedy.json"
    assert lin.steps == 20
    curves = "metrics/smollm2/train_curves.csv"
    assert lin.plots == ("held-out-accuracy", "entropy", "response-length", "clip-fractions", curves)
    # the data and the imported model, not the base model's evaluation (no experiment needs it)
    assert sorted(upstream_stages(ROOT, lin)) == [
        "pipelines/smollm2/dvc.yaml:import",
        "pipelines/smollm2/dvc.yaml:prepare",
    ]


def test_the_real_model_lineage_plots_every_curve_of_the_table_against_the_step():
    import yaml  # type: ignore[import-untyped]

    plots = yaml.safe_load((ROOT / "pipelines/smollm2/dvc.yaml").read_text())["plots"]
    fields: set[str] = set()
    for entry in plots:
        (spec,) = entry.values()
        assert spec["x"] == "step"
        for path, ys in spec["y"].items():
            assert path == "../../metrics/smollm2/train_curves.csv"  # relative to the dvc.yaml
            fields.update([ys] if isinstance(ys, str) else ys)
    assert fields == {"val_acc", "entropy", "response_len", "clipfrac", "clipfrac_lower"}


def test_the_tiny_lineage_has_no_greedy_evaluation():
    lin = read_lineage(ROOT, "dvc.yaml")
    assert lin.params_file == "params.yaml" and lin.stages == ("dvc.yaml:train", "dvc.yaml:evaluate")
    assert lin.plots == ("metrics/train_curves.csv",)
    assert (lin.metrics.train, lin.metrics.sampled, lin.metrics.greedy) == (
        "metrics/train.json",
        "metrics/eval.json",
        None,
    )
    assert sorted(upstream_stages(ROOT, lin)) == ["base_model", "prepare"]


def test_a_lineage_without_the_stages_or_file_is_refused(tmp_path):
    with pytest.raises(AblationError, match="no such file"):
        read_lineage(tmp_path, "dvc.yaml")
    (tmp_path / "dvc.yaml").write_text("stages:\n  train:\n    cmd: echo\n")
    with pytest.raises(AblationError, match="no stage evaluate"):
        read_lineage(tmp_path, "dvc.yaml")
    (tmp_path / "dvc.yaml").write_text("stages:\n  train:\n    cmd: echo\n  evaluate:\n    cmd: echo\n")
    with pytest.raises(AblationError, match="metrics"):
        read_lineage(tmp_path, "dvc.yaml")


def test_pending_lists_the_unfinished_records_of_the_grid_only():
    records = [
        ExpRecord("a", {}, {}, True, "success"),
        ExpRecord("b", {}, {}, False, "queued"),
        ExpRecord("c", {}, {}, False, "failed"),
        ExpRecord("c", {}, {}, False, "running"),
        ExpRecord("d", {}, {}, False, None),
        ExpRecord("other", {}, {}, False, "queued"),
    ]
    assert pending(records, {"a", "b", "c", "d"}) == {
        "b": ["queued"],
        "c": ["failed", "running"],
        "d": ["error"],
    }
