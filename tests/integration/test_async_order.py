"""The async step order (`trainer.step_order=async`): batch k+1 is generated while the actor trains on batch
k, on a local Ray where the two overlap for real. Checked: every trained sample is at most
`trainer.max_staleness` weight versions old (logged per step), the stale ones get the rollout IS correction
(with the recomputed old log-probs: the decoupled objective), `max_staleness=0` generates nothing ahead, and
a run whose actor dies mid-update (one automatic restart) and which is later SIGKILLed after its first
checkpoint, each time with the next batch in flight, resumes to the bits and the step and sample accounting
of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from dapo_core.store import RunStore
from tests.integration.conftest import (
    CONFIG,
    SHORT_RUN,
    kill_and_resume,
    tiny_overrides,
    train_cmd,
    train_here,
)
from tests.integration.test_self_healing import kill_to_commit_s

pytestmark = pytest.mark.slow

ASYNC = {
    "trainer.step_order": "async",
    "trainer.max_staleness": 1,
    "algorithm.rollout_correction.rollout_is": "token",
    "trainer.use_ray": "true",
    "data.gen_batch_size": 4,  # = train_batch_size: each step trains exactly the batch made during the last
    "data.max_response_length": 16,
    "reward_model.overlong_buffer.len": 12,  # rewards vary within a group: the updates move the weights
}
ROOT = Path(__file__).resolve().parents[2]


def _overrides(assets: Path, name: str, **extra) -> list[str]:
    return tiny_overrides(assets, **{**SHORT_RUN, **ASYNC, **extra, "trainer.experiment_name": name})


def _cmd(assets: Path, name: str, **extra) -> list[str]:
    return train_cmd(_overrides(assets, name, **extra))


def _metrics(run: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)
    return out


@pytest.fixture(scope="module")
def async_straight(tiny_assets) -> Path:
    """The uninterrupted async run (`ASYNC`, 3 steps on a local Ray), trained once for this module's tests by
    `dapo train`; its run folder. Read-only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = subprocess.run(
        _cmd(tiny_assets, "async_straight"), env=env, cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    return tiny_assets / "runs" / "async_straight"


def test_async_order_bounds_staleness_and_corrects_it(async_straight):
    run = async_straight
    metrics = _metrics(run)
    with RunStore(run) as store:
        for k in (1, 2, 3):
            m = metrics[k]
            stages = set(store.committed_stages(k))
            versions = set(store.read_stage(k, "batch").column("weight_version").to_pylist())
            lag = m["training/off_policy/weight_version_lag_max"]
            assert lag == (0 if k == 1 else 1) == max(k - 1 - v for v in versions), (k, versions)
            assert "old_log_prob_p0" in stages  # π_old is recomputed: the samples are off-policy
            assert "rollout_corr/rollout_is_mean" in m, sorted(m)  # and corrected
            assert ("generate_ga" in stages) == (k < 3)  # the next batch, generated during this update
        weights = store.read_stage(2, "advantage_p0").column("rollout_is_weights").to_pylist()
        assert any(abs(w - 1.0) > 1e-6 for row in weights for w in row)  # stale samples are reweighted


FAULT = "kill@update_actor:1"
"""The actor dies in step 1's update, while step 2's batch is being generated."""


@pytest.mark.timeout(900)
def test_async_run_killed_with_a_batch_in_flight_resumes_bitwise(tiny_assets, async_straight):
    """`dapo train` of the async run with one automatic restart: the actor SIGKILLs itself in step 1's update
    (`DAPO_FAULT`) with step 2's batch in flight, and the run restarts from the start by itself; it is
    SIGKILLed once step 3's batch is being made (after checkpoint 1) and resumed in this process. It ends
    with the uninterrupted run's bits and the same accounting: every step trained `train_batch_size` groups,
    no group twice, every generated group trained (none dropped, none evicted), nothing left in flight."""
    run = tiny_assets / "runs" / "async_resumed"
    log = tiny_assets / "async_resumed.log"
    restart = {"trainer.max_restarts": 1}

    def restarted_then_killed_after_checkpoint_1(resumed: Path) -> None:
        assert (resumed / "ckpt" / "latest").read_text().strip() == "1"
        text = log.read_text(errors="replace")
        said = re.search(r"restart 1 of 1 .*a worker died at stage 'update_actor\S*' of step 1 .*", text)
        assert said and "resuming from the start" in said.group(0), text[-3000:]
        marker = FAULT.replace(":", "#0:")
        print(
            f"async: actor killed in update_actor: {kill_to_commit_s(resumed, marker)} s to the next commit"
        )

    kill_and_resume(
        _cmd(tiny_assets, "async_resumed", **restart),
        run,
        "step_000002/prompts_ga.manifest.json",  # step 3's batch is being made
        env={**os.environ, "OMP_NUM_THREADS": "1", "DAPO_FAULT": FAULT},
        after_kill=restarted_then_killed_after_checkpoint_1,
        resume=lambda: train_here(_overrides(tiny_assets, "async_resumed", **restart)),
        reference=async_straight,
        log=log,
    )
    metrics = _metrics(run)
    # the restart counts within its flow run: step 1's row says 1, the resumed attempt's rows 0
    assert [(k, m["fault/restarts"]) for k, m in sorted(metrics.items())] == [(1, 1.0), (2, 0.0), (3, 0.0)]
    with RunStore(run) as store, RunStore(async_straight) as straight:
        made: set[str] = set()  # every prompt group a committed prompts stage issued
        trained: list[str] = []
        for k in (1, 2, 3):
            for stage in store.committed_stages(k):
                if stage.startswith("prompts_"):
                    made |= set(store.read_stage(k, stage).column("uid").to_pylist())
            uids = store.read_stage(k, "batch").column("uid").to_pylist()
            assert uids == straight.read_stage(k, "batch").column("uid").to_pylist(), k
            groups = Counter(uids)
            assert len(groups) == 4 and len(set(groups.values())) == 1, (k, groups)  # whole groups
            trained += list(groups)
            for why in ("off_policy", "filter_groups", "rollout_failure"):
                assert metrics[k][f"training/{why}/evicted_samples"] == 0, (k, why)
        assert len(trained) == len(set(trained)) == 12  # no group trained twice
        assert set(trained) == made  # none dropped
        inflight = [
            u for u, t in store.items("train", is_prompt=True) if t.get("status") in ("pending", "running")
        ]
        assert inflight == []


@pytest.mark.timeout(600)
def test_async_order_with_no_staleness_generates_nothing_ahead(tiny_assets):
    from dapo_core.config import load_config, to_yaml
    from flows.dapo_train import dapo_train

    over = {**SHORT_RUN, **ASYNC, "trainer.max_staleness": 0, "trainer.use_ray": "false"}
    over.pop("algorithm.rollout_correction.rollout_is")
    out = dapo_train(to_yaml(load_config(CONFIG, tiny_overrides(tiny_assets, **over))), "async_fresh")
    run = Path(out["run_dir"])
    metrics = _metrics(run)
    with RunStore(run) as store:
        for k in (1, 2, 3):
            assert metrics[k]["training/off_policy/weight_version_lag_max"] == 0
            assert not any(s.endswith("_ga") for s in store.committed_stages(k))


@pytest.mark.timeout(600)
def test_async_order_in_bypass_mode_trains_stale_samples_without_an_old_log_prob_forward(tiny_assets):
    # Bypass mode: π_old is the rollout's log-probs, so no stage recomputes them; the update corrects the
    # stale samples against π_θ per micro-batch (its `rollout_corr/*` metrics).
    from dapo_core.config import load_config, to_yaml
    from flows.dapo_train import dapo_train

    over = {
        **SHORT_RUN,
        **ASYNC,
        "algorithm.rollout_correction.bypass_mode": "true",
        "trainer.use_ray": "false",
    }
    out = dapo_train(to_yaml(load_config(CONFIG, tiny_overrides(tiny_assets, **over))), "async_bypass")
    run = Path(out["run_dir"])
    metrics = _metrics(run)
    with RunStore(run) as store:
        for k in (1, 2, 3):
            m = metrics[k]
            stages = set(store.committed_stages(k))
            assert m["training/off_policy/weight_version_lag_max"] == (0 if k == 1 else 1)
            assert not any(s.startswith("old_log_prob") for s in stages), sorted(stages)
            assert m["timing_s/old_log_prob"] == 0.0
            assert "actor/rollout_corr/rollout_is_mean" in m, sorted(m)  # from the loss
            assert m["actor/entropy"] > 0  # from the update's forward, as the skipped stage would log it
            assert m["timing_s/sync_weights"] > 0  # one push a step, after the update
        assert metrics[2]["actor/ppo_kl"] != 0.0  # the ratio is against the policy that sampled them
