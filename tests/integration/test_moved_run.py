"""A run folder moved to another directory and resumed from there (issue 30, an operator's case).

A sync-order run keeps no absolute path: killed, moved and resumed with the new `trainer.runs_dir`, it ends
bitwise equal to the uninterrupted run. A replay-buffer run's ledger names its stage files by their absolute
location, so the resumed run used to die at its next checkpoint (after Prefect and the workers started) with
"... is not a stage file of the run folder ..."; it is now refused by the preflight with one paragraph that
names both folders and the fix, and resumed where it was written (through a link) it ends bitwise equal.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dapo_core.config import load_config, to_yaml
from tests.integration.conftest import CONFIG, SHORT_RUN, tiny_overrides

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
def test_a_moved_sync_run_resumes_bitwise_from_its_new_folder(tiny_assets):
    old, new = tiny_assets / "runs_sync_old", tiny_assets / "runs_sync_new"
    assert _train(tiny_assets, old, "sync")["train_step"] == 3
    straight = _weights(old / RUN, 3)
    _killed_before_step_3_was_saved(old / RUN)
    new.mkdir()
    shutil.move(str(old / RUN), str(new / RUN))
    out = _train(tiny_assets, new, "sync")
    assert out["train_step"] == 3 and Path(out["run_dir"]) == new / RUN
    resumed = _weights(new / RUN, 3)
    assert all((straight[k] == resumed[k]).all() for k in straight)


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
