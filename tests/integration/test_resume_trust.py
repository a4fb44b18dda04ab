"""Resume trust on the real dapo-train flow (real Prefect, in-process workers, real run store):
a lost `latest` pointer is recovered (never a restart at step 0) and the run ends bitwise equal to an
uninterrupted one; a corrupted stage file shadowed by a later stage is found and recomputed; metrics rows are
never duplicated; every attempt's config is kept and secrets stay `${oc.env:...}` references; changed inputs
are refused (or, when allowed, the stored rollouts are regenerated); a lost ledger is refused; `dapo eval`
verifies a checkpoint named by its step folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dapo_core.config import load_config, to_yaml
from dapo_core.store import RunStore, StoreError
from dapo_core.store.checkpoint import CheckpointError
from dapo_core.store.fingerprints import InputsChanged
from tests.integration.conftest import (
    CONFIG,
    REFERENCE_RUN,
    SECRET,
    actor_weights,
    copy_run,
    kill_and_resume,
    tiny_overrides,
    train_cmd,
)

pytestmark = pytest.mark.slow

COMMON = {**REFERENCE_RUN, "trainer.experiment_name": "trust"}  # the project name is a secret's reference


def _train(root: Path, run_id: str = "trust", **extra) -> dict:
    from flows.dapo_train import dapo_train

    cfg = load_config(CONFIG, tiny_overrides(root, **{**COMMON, **extra}))
    return dapo_train(to_yaml(cfg), run_id)


def _metric_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _crash_after_logging_step_3(run: Path) -> None:
    """What a kill after step 3's metrics row, before its checkpoint is complete, leaves; and no pointer."""
    shutil.rmtree(run / "ckpt" / "step_3")
    (run / "ckpt" / "latest").unlink()


@pytest.mark.timeout(900)
def test_resume_recovers_verifies_and_keeps_records(tiny_assets, short_reference, tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_TEST_API_KEY", SECRET)
    run = copy_run(short_reference, tmp_path / "runs")  # the uninterrupted run, trained with COMMON's config
    straight = actor_weights(short_reference, 3)

    def resume(**extra) -> dict:
        """Resume the copy (its name and folder) with COMMON and `extra`."""
        where = {"trainer.experiment_name": run.name, "trainer.runs_dir": str(run.parent)}
        return _train(tiny_assets, run_id=run.name, **where, **extra)

    first_record = (run / "config.1.yaml").read_text()
    assert _metric_steps(run) == [1, 2, 3] and "${oc.env:DAPO_TEST_API_KEY}" in first_record
    assert json.loads((run / "inputs.json").read_text())["data"]["train"]["rows"] == 400

    # 1. lost pointer + a corrupted stage file shadowed by later stages of the replayed step
    _crash_after_logging_step_3(run)
    gen = run / "step_000003" / "generate_g0.arrow"
    data = bytearray(gen.read_bytes())
    data[len(data) // 2] ^= 0xFF
    gen.write_bytes(bytes(data))
    out = resume()
    assert out["train_step"] == 3  # resumed at step 2 (not restarted at 0) and re-ran step 3
    resumed = actor_weights(run, 3)
    assert all((straight[k] == resumed[k]).all() for k in straight)  # bitwise equal to the uninterrupted run
    with RunStore(run) as store:
        store.verify_stage(3, "generate_g0")  # the corrupted file was found and recomputed
    assert _metric_steps(run) == [1, 2, 3]  # step 3 logged again, not twice
    assert (run / "config.1.yaml").read_text() == first_record  # earlier attempt's record kept
    for name in ("config.2.yaml", "config.yaml", "inputs.json", "metrics.jsonl"):
        assert SECRET not in (run / name).read_text(), name

    # 2. changed data under the resumed run: refused before anything is written, naming what changed
    _crash_after_logging_step_3(run)
    (run / "ckpt" / "latest").write_text("2\n")
    table = pq.read_table(tiny_assets / "data" / "train.parquet")
    changed = tiny_assets / "data" / "train_changed.parquet"
    pq.write_table(table.take(list(range(table.num_rows - 1, -1, -1))), changed)  # same rows, re-ordered
    with pytest.raises(InputsChanged) as ei:
        resume(**{"data.train_files": f"[{changed}]"})
    msg = str(ei.value)
    assert "train data" in msg and "train_changed.parquet" not in msg and "allow_changed_inputs" in msg
    assert not (run / "config.3.yaml").exists()  # no record for an attempt that did not pass setup

    # 3. ... allowed explicitly: the stored rollouts of step 3 (old data) are regenerated, never replayed
    before = json.loads((run / "step_000003" / "prompts_g0.manifest.json").read_text())["created"]
    out = resume(**{"data.train_files": f"[{changed}]", "trainer.allow_changed_inputs": "true"})
    assert out["train_step"] == 3 and (run / "config.3.yaml").exists()
    assert json.loads((run / "step_000003" / "prompts_g0.manifest.json").read_text())["created"] > before
    assert (run / "inputs.3.replaced.json").exists()
    recorded = json.loads((run / "inputs.json").read_text())["data"]["train"]["files"]
    assert [Path(f["path"]).name for f in recorded] == ["train_changed.parquet"]

    # 4. `dapo eval --checkpoint runs/X/ckpt/step_N` verifies the checkpoint like `--checkpoint runs/X`
    from flows.evaluate import resolve_checkpoint

    step2 = run / "ckpt" / "step_2"
    assert resolve_checkpoint(str(step2)) == str(step2 / "actor")
    weights = step2 / "actor" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    for named in (step2, step2 / "actor"):
        with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupted"):
            resolve_checkpoint(str(named))

    # 5. a lost ledger is refused, not silently re-created empty
    (run / "ledger.sqlite").unlink()
    for side in run.glob("ledger.sqlite-*"):
        side.unlink()
    with pytest.raises(StoreError, match="ledger"):
        resume(**{"data.train_files": f"[{changed}]"})
    assert not (run / "ledger.sqlite").exists()


def test_full_disk_during_a_commit_leaves_a_consistent_store_and_resumes(tiny_assets, monkeypatch):
    """Every write of step 1's reward stage fails with ENOSPC (`files.FAULT_ENV`, as a full disk would): the
    run stops with a DiskFull paragraph naming the file and the fix (the task's retries hit it too), the store
    holds the stages committed before it and no temp file; the same run then finishes once space is back."""
    from dapo_core.store import files as store_files
    from dapo_core.store.files import DiskFull

    monkeypatch.setenv("DAPO_TEST_API_KEY", SECRET)
    monkeypatch.setenv(store_files.FAULT_ENV, "step_000001/reward_g0.arrow")
    extra = {"trainer.experiment_name": "diskfull", "trainer.total_training_steps": 1}
    with pytest.raises(DiskFull) as ei:
        _train(tiny_assets, run_id="diskfull", **extra)
    msg = str(ei.value)
    assert "disk is full" in msg and "reward_g0.arrow" in msg and "Fix:" in msg and "resume" in msg
    run = tiny_assets / "runs" / "diskfull"
    with RunStore(run) as store:
        assert "generate_g0" in store.committed_stages(1) and "reward_g0" not in store.committed_stages(1)
    assert not [p for p in (run / "step_000001").iterdir() if ".tmp-" in p.name]
    monkeypatch.delenv(store_files.FAULT_ENV)
    assert _train(tiny_assets, run_id="diskfull", **extra)["train_step"] == 1
    assert (run / "ckpt" / "latest").read_text().strip() == "1" and _metric_steps(run) == [1]


@pytest.mark.timeout(900)
def test_killed_worker_stops_with_one_paragraph_and_the_run_resumes(tiny_assets):
    """SIGKILL one worker (a Ray actor process of this `dapo train` run) inside step 2: the CLI exits 2
    with one paragraph naming the run, the stage and how to resume, no traceback; the run then resumes from
    checkpoint 1 (in-process workers here, to keep the test short) and finishes."""
    import os
    import subprocess

    import psutil

    ov = tiny_overrides(
        tiny_assets,
        **{
            **COMMON,
            "trainer.experiment_name": "workerkill",
            "trainer.use_ray": "true",
            "trainer.total_training_steps": 2,
        },
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DAPO_TEST_API_KEY": SECRET}
    run = tiny_assets / "runs" / "workerkill"
    log = tiny_assets / "workerkill.log"

    def kill_one_worker(proc: subprocess.Popen) -> None:
        ours = psutil.Process(proc.pid).children(recursive=True)  # only this run's Ray processes
        workers = [p for p in ours if any("_RayHost" in part for part in p.cmdline())]  # "ray::_RayHost"
        assert len(workers) >= 3, [p.cmdline()[:1] for p in ours]
        min(workers, key=lambda p: p.pid).kill()  # one worker (each is used in step 2)
        assert proc.wait(timeout=600) == 2, log.read_text()[-3000:]  # the run stops by itself

    def stopped_with_one_paragraph(_run: Path) -> None:
        err = log.read_text()
        assert "worker process of run workerkill died" in err and "step 2" in err and "Fix:" in err, err[
            -3000:
        ]
        assert "Traceback" not in err

    extra = {"trainer.experiment_name": "workerkill", "trainer.total_training_steps": 2}
    kill_and_resume(
        train_cmd(ov),
        run,
        "step_000002/prompts_g0.manifest.json",
        env=env,
        kill=kill_one_worker,
        after_kill=stopped_with_one_paragraph,
        resume_cmd=train_cmd(tiny_overrides(tiny_assets, **{**COMMON, **extra})),  # in-process workers
        log=log,
    )
    assert (run / "ckpt" / "latest").read_text().strip() == "2" and _metric_steps(run) == [1, 2]
