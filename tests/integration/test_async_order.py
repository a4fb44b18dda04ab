"""The async step order (`trainer.step_order=async`): batch k+1 is generated while the actor trains on batch
k, on a local Ray where the two overlap for real. Checked: every trained sample is at most
`trainer.max_staleness` weight versions old (logged per step), the stale ones get the rollout IS correction
(with the recomputed old log-probs: the decoupled objective), `max_staleness=0` generates nothing ahead, and
a run SIGKILLed after its first checkpoint, while the next batch is in flight, resumes to the bits of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
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


@pytest.mark.timeout(900)
def test_async_run_killed_with_a_batch_in_flight_resumes_bitwise(tiny_assets, async_straight):
    def killed_after_checkpoint_1(resumed: Path) -> None:
        assert (resumed / "ckpt" / "latest").read_text().strip() == "1"

    kill_and_resume(
        _cmd(tiny_assets, "async_resumed"),
        tiny_assets / "runs" / "async_resumed",
        "step_000002/prompts_ga.manifest.json",  # step 3's batch is being made
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        after_kill=killed_after_checkpoint_1,
        resume=lambda: train_here(_overrides(tiny_assets, "async_resumed")),
        reference=async_straight,
        log=tiny_assets / "async_resumed.log",
    )


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
