"""DVC's train stage (`python -m flows.pipeline dvc-train`, `flows.pipeline.main`) checks what `dapo train`
checks before it starts a Prefect server, and ends every way in one paragraph.

The Prefect server start and the training are replaced by recorders: a case that got past the checks shows
up as a recorded call.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from tests.helpers import write_good_inputs

    return write_good_inputs(tmp_path_factory.mktemp("dvc_entry"))


def _params(tmp_path: Path, inputs: Path, **extra: str) -> Path:
    """A params.yaml of the DVC stage pointing at good inputs (`extra`: more `section.key: value` lines)."""
    lines = [
        f"base: {ROOT / 'configs' / 'tiny_cpu.yaml'}",
        "data:",
        f"  train_files: [{inputs / 'train.parquet'}]",
        f"  val_files: [{inputs / 'val.parquet'}]",
        *(f"  {k.removeprefix('data.')}: {v}" for k, v in extra.items() if k.startswith("data.")),
        "  synthetic:",
        "    enable: false",
        "actor_rollout_ref:",
        "  model:",
        f"    path: {extra.get('model', inputs / 'model')}",
        "trainer:",
        f"  runs_dir: {tmp_path / 'runs'}",
    ]
    p = tmp_path / "params.yaml"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture
def stage(monkeypatch):
    """Record the Prefect server start and the training instead of running them."""
    import flows.pipeline as pl

    calls: list = []
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("DAPO_DEBUG", raising=False)
    monkeypatch.setattr(pl, "start_local_prefect", lambda command: calls.append(("prefect", command)))
    monkeypatch.setattr(pl, "dvc_train", lambda *a, **kw: calls.append(("train", a, kw)))
    monkeypatch.setattr(pl, "quiet_user_error_tracebacks", lambda debug=False: None)
    monkeypatch.setattr(pl, "quiet_worker_noise", lambda: None)
    return pl, calls


def _run(pl, params: Path, capsys, *extra: str) -> tuple[int, str]:
    code = pl.main(["dvc-train", "--config", str(params), "--milestones", "2", *extra])
    err = capsys.readouterr().err
    assert "Traceback" not in err and 'File "' not in err, err
    return code, err


def test_good_inputs_start_prefect_after_the_checks(stage, inputs, tmp_path, capsys):
    pl, calls = stage
    code, err = _run(pl, _params(tmp_path, inputs), capsys)
    assert code == 0, err
    assert [c[0] for c in calls] == ["prefect", "train"]
    assert calls[1][2]["cfg_yaml"] and calls[1][1][1] == [2]


@pytest.mark.parametrize(
    ("why", "extra", "expect"),
    [
        ("model folder missing", {"model": "/nonexistent/model"}, ("model folder", "does not exist")),
        (
            "response beyond the model's positions",
            {"data.max_response_length": "600"},
            ("max_position_embeddings", "data.max_response_length", "Fix:"),
        ),
    ],
)
def test_a_bad_input_is_one_paragraph_before_prefect(stage, inputs, tmp_path, capsys, why, extra, expect):
    pl, calls = stage
    code, err = _run(pl, _params(tmp_path, inputs, **extra), capsys)
    assert code == 2, err
    assert calls == [], f"{why}: got past the checks"
    lines = [ln for ln in err.splitlines() if ln.startswith("dapo dvc-train: ")]
    assert len(lines) == 1, err
    for part in expect:
        assert part in lines[0], (part, err)


def test_a_live_writer_of_the_stages_run_is_refused_before_prefect(stage, inputs, tmp_path, capsys):
    """The stage's run id (dvc-<hash>) is held by another host's live process: refused, nothing changed."""
    from dapo_core.config import load_config, to_safe_yaml

    pl, calls = stage
    params = _params(tmp_path, inputs)
    run = tmp_path / "runs" / pl.dvc_run_id(to_safe_yaml(load_config(str(params))))
    run.mkdir(parents=True)
    now = time.time()
    lease = {"host": "gpu-node-3", "pid": 4242, "started": 0.0, "flow_run_id": "f-9", "token": "t",
             "acquired": now - 60, "heartbeat": now - 2}  # fmt: skip
    (run / "lease.json").write_text(json.dumps(lease))
    before = sorted(p.name for p in run.iterdir())
    code, err = _run(pl, params, capsys)
    assert code == 2 and calls == [], err
    assert "being written by another process" in err and "gpu-node-3 pid 4242" in err and run.name in err
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_failure_in_training_is_one_paragraph_naming_the_log(stage, inputs, tmp_path, capsys, monkeypatch):
    pl, _ = stage

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("worker 3 lost its connection\nsecond line")

    monkeypatch.setattr(pl, "dvc_train", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    code, err = _run(pl, _params(tmp_path, inputs), capsys)
    assert code == 1, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("dapo dvc-train: failed with RuntimeError")]
    assert "worker 3 lost its connection" in line and "--debug" in line and "second line" not in err
    log = Path(line.split("the full traceback is in ")[1].split(". Run again")[0])
    assert "Traceback" in log.read_text()


def test_bad_milestones_are_one_paragraph(stage, inputs, tmp_path, capsys):
    pl, calls = stage
    code = pl.main(["dvc-train", "--config", str(_params(tmp_path, inputs)), "--milestones", "10,x"])
    err = capsys.readouterr().err
    assert code == 2 and calls == [] and "Traceback" not in err
    assert "--milestones '10,x'" in err and "Fix:" in err


def test_an_output_folder_that_cannot_be_written_is_refused_before_training(stage, inputs, tmp_path, capsys):
    pl, calls = stage
    (tmp_path / "afile").write_text("not a folder")
    models = str(tmp_path / "afile" / "models")
    code, err = _run(pl, _params(tmp_path, inputs), capsys, "--models-dir", models)
    assert code == 2 and calls == [], err
    assert "cannot write in" in err and "--models-dir" in err and "a path under a file" in err
