"""A run folder moved to another directory and resumed from there (an operator's case).

A sync-order run keeps no absolute path: killed, moved and resumed with the new `trainer.runs_dir` (a copy of
the session's reference run, whose own folder is out of reach while the copy resumes), it ends bitwise equal
to the uninterrupted run. A replay-buffer run's ledger names its stage files by their absolute location, so
a resume from a new folder would fail at its next checkpoint (after Prefect and the workers started) with
"... is not a stage file of the run folder ..."; the preflight refuses it with one paragraph that names both
folders and the fix, and resumed where it was written (through a link) it ends bitwise equal.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dapo_core.config import load_config, to_yaml
from tests.integration.conftest import (
    CONFIG,
    SECRET,
    SHORT_RUN,
    assert_same_weights,
    copy_run,
    reference_overrides,
    tiny_overrides,
)

pytestmark = pytest.mark.slow

RUN = "moved"


def _overrides(root: Path, runs: Path, order: str) -> list[str]:
    extra = {**SHORT_RUN, "trainer.experiment_name": RUN, "trainer.runs_dir": str(runs)}
    return tiny_overrides(root, **extra, **{"trainer.step_order": order})


def _train(root: Path, runs: Path, order: str) -> dict:
    from flows.dapo_train import dapo_train

    return dapo_train(to_yaml(load_config(CONFIG, _overrides(root, runs, order))), RUN)


def _weights(run: Path, step: int) -> dict:
    return load_file(str(run / "ckpt" / f"step_{step}" / "actor" / "model.safetensors"))


def _killed_before_step_3_was_saved(run: Path) -> None:
    """What a kill after step 3's stages, before its checkpoint was complete, leaves."""
    shutil.rmtree(run / "ckpt" / "step_3")
    (run / "ckpt" / "latest").write_text("2\n")


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.timeout(1200)
def test_a_moved_sync_run_resumes_bitwise_from_its_new_folder(
    tiny_assets, short_reference, tmp_path, monkeypatch
):
    from flows.dapo_train import dapo_train

    monkeypatch.setenv("DAPO_TEST_API_KEY", SECRET)  # the reference run's project name reads it
    new = tmp_path / "runs_sync_new"
    run = copy_run(short_reference, new)
    _killed_before_step_3_was_saved(run)
    cfg = load_config(CONFIG, reference_overrides(tiny_assets, new))
    away = short_reference.with_name(f"{short_reference.name}.away")
    short_reference.rename(away)  # the folder the run was written in is gone, as after a move
    try:
        out = dapo_train(to_yaml(cfg), run.name)
    finally:
        away.rename(short_reference)
    assert out["train_step"] == 3 and Path(out["run_dir"]) == run
    assert_same_weights(short_reference, run, 3)


@pytest.mark.timeout(1200)
def test_a_moved_replay_buffer_run_is_refused_and_resumes_where_it_was_written(tiny_assets, capsys):
    from flows.cli import main

    old, new = tiny_assets / "runs_replay_old", tiny_assets / "runs_replay_new"
    assert _train(tiny_assets, old, "replay_buffer")["train_step"] == 3
    straight = _weights(old / RUN, 3)
    _killed_before_step_3_was_saved(old / RUN)
    new.mkdir()
    shutil.move(str(old / RUN), str(new / RUN))
    before = _snapshot(new / RUN)
    capsys.readouterr()

    code = main(
        ["train", "--flow-only", "--config", str(CONFIG), *_overrides(tiny_assets, new, "replay_buffer")]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "Prefect server" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("dapo train: run moved was written at")]
    assert str(old / RUN) in line and str(new / RUN) in line and "ln -s" in line
    assert f"trainer.runs_dir={old}" in line
    assert _snapshot(new / RUN) == before  # nothing of the run changed

    (old / RUN).symlink_to(new / RUN)  # the fix the paragraph gives
    out = _train(tiny_assets, old, "replay_buffer")
    assert out["train_step"] == 3
    resumed = _weights(new / RUN, 3)
    assert all((straight[k] == resumed[k]).all() for k in straight)
