"""Self-healing runs on the real dapo-train flow (real Prefect, a local Ray, real worker processes): a worker
process that SIGKILLs itself (`DAPO_FAULT=kill@...`) or hangs (`hang@...`, caught by
`trainer.stage_timeout_s`) restarts the run's workers by itself, and the run ends bitwise equal to an
uninterrupted one; a worker that dies on every attempt spends `trainer.max_restarts` and ends the run with
one paragraph naming the stage and step of each failure."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dapo_core.config import load_config, to_yaml
from tasks.faults import WorkerDied
from tests.integration.conftest import CONFIG, SHORT_RUN, assert_same_weights, tiny_overrides

pytestmark = pytest.mark.slow

ON_RAY = {**SHORT_RUN, "trainer.use_ray": "true", "trainer.max_restarts": 2}
"""The reference run's config (`SHORT_RUN`, 3 steps checkpointed every step) on Ray, with two restarts."""


def _train(root: Path, runs: Path, name: str, **extra) -> dict:
    from flows.dapo_train import dapo_train

    over = tiny_overrides(root, **{**ON_RAY, "trainer.runs_dir": str(runs), "trainer.experiment_name": name})
    over += [f"{k}={v}" for k, v in extra.items()]
    return dapo_train(to_yaml(load_config(CONFIG, over)), name)


@pytest.mark.timeout(600)
def test_killed_rollout_and_reward_workers_restart_and_train_the_same_weights(
    tiny_assets, short_reference, tmp_path, monkeypatch, caplog
):
    # the rollout worker dies while generating step 2 (the restart resumes from checkpoint 1, replaying the
    # step's committed prompts), the reward worker while scoring step 3 (resumed from checkpoint 2 and the
    # committed generation)
    monkeypatch.setenv("DAPO_FAULT", "kill@generate_g0:2,kill@reward_g0:3")
    out = _train(tiny_assets, tmp_path / "runs", "healed")
    assert out["train_step"] == 3
    run = Path(out["run_dir"])
    assert_same_weights(short_reference, run, 3)  # the uninterrupted run, in-process workers
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["fault/restarts"]) for r in rows] == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert sorted(p.name for p in (run / "faults").iterdir()) == [
        "kill@generate_g0#0:2.done",
        "kill@reward_g0#0:3.done",
    ]
    text = "\n".join(r.getMessage() for r in caplog.records)  # the flow run's log
    first = re.search(r"restart 1 of 2 .*: a worker died at stage 'generate_g0' of step 2 .*", text)
    second = re.search(r"restart 2 of 2 .*: a worker died at stage 'reward_g0' of step 3 .*", text)
    assert first and "resuming from checkpoint step 1" in first.group(0), text[-3000:]
    assert second and "resuming from checkpoint step 2" in second.group(0), text[-3000:]
    assert "(worker 'rollout" in first.group(0) and "(worker 'reward', pid" in second.group(0)
    for fault in ("kill@generate_g0#0:2", "kill@reward_g0#0:3"):
        print(f"{fault}: {kill_to_commit_s(run, fault)} s from the kill to the next commit")
    summary = _newest_artifact("dapo-healed-summary")  # the Prefect UI's summary card
    assert "automatic restarts: 2" in summary and "restart 2 of 2" in summary, summary


def kill_to_commit_s(run: Path, fault: str) -> float:
    """Seconds from the moment the worker fault `fault` (a `DAPO_FAULT` item as its marker names it, e.g.
    `kill@update_actor#1:2`) acted in the run folder `run` to the first stage committed after it."""
    acted = float((run / "faults" / f"{fault}.done").read_text().split(" at ")[1])
    after = [t for p in run.glob("step_*/*.manifest.json") if (t := p.stat().st_mtime) > acted]
    assert after, f"no stage of {run} was committed after {fault} acted"
    return round(min(after) - acted, 1)


def _newest_artifact(key: str) -> str:
    """The newest version of artifact `key` on the Prefect API the tests use."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC
        )
    return str(found[0].data) if found else ""


@pytest.mark.timeout(600)
def test_a_hang_is_restarted_and_a_crash_on_every_attempt_spends_the_budget(
    tiny_assets, tmp_path, monkeypatch
):
    # the rollout worker hangs once generating step 1 (caught after 20 s: restart 1 of 1), then the reward
    # worker dies whenever it scores step 1 (a deterministic crash: no restart is left)
    monkeypatch.setenv("DAPO_FAULT", "hang@generate_g0:1,kill-always@reward_g0:1")
    extra = {"trainer.max_restarts": 1, "trainer.stage_timeout_s": 20, "trainer.total_training_steps": 1}
    with pytest.raises(WorkerDied) as err:
        _train(tiny_assets, tmp_path / "runs", "doomed", **extra)
    text = str(err.value)
    assert "died during stage 'reward_g0' of step 1" in text
    assert "restarted 1 time(s) by itself (trainer.max_restarts=1" in text
    assert "after a worker hung at stage 'generate_g0' of step 1; no restart is left" in text
    assert "Traceback" not in text and "\n" not in text.strip()
    run = tmp_path / "runs" / "doomed"
    # the hang acted once (its marker), the crash on every attempt (none)
    assert sorted(p.name for p in (run / "faults").iterdir()) == ["hang@generate_g0#0:1.done"]
    assert (run / "step_000001" / "generate_g0.manifest.json").exists()  # committed by the new worker
    assert not (run / "step_000001" / "reward_g0.manifest.json").exists()
