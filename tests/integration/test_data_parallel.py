"""Data-parallel actor (FSDP2 over gloo, one thread per rank) in the real flow: dp=2 with two rollout replicas
learns like dp=1 with one (the same weights and logged figures), every rank is listed in workers.json, and a
dp=2 run that loses an actor rank mid-update (the whole group restarts by itself from the rank shards of its
last checkpoint) ends with the same bits as an uninterrupted one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo_core.config import load_config, to_yaml
from dapo_core.store import RunStore
from tests.helpers import build_once
from tests.integration.conftest import CONFIG, SHORT_RUN, tiny_overrides
from tests.integration.test_self_healing import kill_to_commit_s

pytestmark = pytest.mark.slow

SIGNAL = {"data.max_response_length": 16, "reward_model.overlong_buffer.len": 12}
"""Rewards that vary within a group (the briefly warmed-up model answers nothing right, but the overlong
penalty grows with the length after 4 tokens), so the advantages and the gradients are not zero."""
DP2 = {
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "trainer.n_gpus_per_node": 2,
    "trainer.use_ray": "true",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": 1,
}
"""Two actor ranks, two rollout replicas, weights pushed rank i to replica i in 1 MiB buckets."""


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "ckpt" / f"step_{step}" / "actor" / "model.safetensors"))


KL = {"actor_rollout_ref.actor.use_kl_loss": "true", "actor_rollout_ref.actor.kl_loss_coef": 0.01}
"""KL loss on: the reference group runs too."""


def _overrides(assets: Path, name: str, dp2: bool, **extra: object) -> list[str]:
    """The 3-step run `name` with varied rewards and the KL loss, checkpointed every step; dp=2 or dp=1;
    then `extra`."""
    return tiny_overrides(
        assets,
        **{**SHORT_RUN, **SIGNAL, **KL, **(DP2 if dp2 else {}), "trainer.experiment_name": name, **extra},
    )


def _train(assets: Path, name: str, dp2: bool, **extra: object) -> Path:
    """Train the run `name` with the flow in this process; its run folder."""
    from flows.dapo_train import dapo_train

    out = dapo_train(to_yaml(load_config(CONFIG, _overrides(assets, name, dp2, **extra))), name)
    assert out["train_step"] == 3
    return Path(out["run_dir"])


@pytest.fixture
def dp2_run(tiny_assets, tmp_path_factory) -> Path:
    """The dp=2 run (on a local Ray), trained once per test run (`build_once`: the module's tests may run on
    different xdist workers); its run folder. Read it only."""

    def build(folder: Path) -> None:
        (folder / "run_dir.txt").write_text(str(_train(tiny_assets, "dp2", dp2=True)))

    return Path((build_once(tmp_path_factory, "dp2", build) / "run_dir.txt").read_text())


@pytest.mark.timeout(900)
def test_dp2_actor_trains_like_dp1_on_the_same_batches(tiny_assets, dp2_run):
    runs = {"dp1": _train(tiny_assets, "dp1", dp2=False), "dp2": dp2_run}
    workers = json.loads((runs["dp2"] / "workers.json").read_text())["workers"]
    ranks = sorted((w["role"], w["rank"]) for w in workers if w["role"] in ("actor", "ref", "rollout"))
    assert ranks == [("actor", 0), ("actor", 1), ("ref", 0), ("ref", 1), ("rollout", 0), ("rollout", 1)]
    one, two = RunStore(runs["dp1"]), RunStore(runs["dp2"])
    for step in (1, 2, 3):  # the same global batches: every step generated the same responses
        a, b = one.read_stage(step, "generate_g0"), two.read_stage(step, "generate_g0")
        assert a.column("response_ids").to_pylist() == b.column("response_ids").to_pylist(), step
        for stage, column in (("old_log_prob", "old_log_probs"), ("ref", "ref_log_probs")):
            lp1 = one.read_stage(step, stage).column(column).to_pylist()
            lp2 = two.read_stage(step, stage).column(column).to_pylist()
            for x, y in zip(lp1, lp2, strict=True):
                assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4), (step, stage)
    w1, w2 = _weights(runs["dp1"], 3), _weights(runs["dp2"], 3)
    base = load_file(str(tiny_assets / "models" / "tiny_base" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    moved = max(float((w1[k] - base[k]).abs().max()) for k in w1)
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    print(f"dp1 vs dp2 after 3 steps: largest weight change {moved:.3g}, largest difference {diff:.3g}")
    assert moved > 1e-4 and diff < 1e-5, (moved, diff)
    logged = {
        name: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for name, run in runs.items()
    }
    figures = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm")
    figures += ("actor/kl_loss",)
    for row in logged["dp2"]:  # each push went rank to replica through shared memory, no message > 1 MiB
        assert row["weight_sync/same_device"] == 1.0, row["step"]
        assert 0 < row["weight_sync/max_message_bytes"] <= 1 << 20, row["step"]
        assert row["weight_sync/buckets"] >= 1 and row["weight_sync/bytes"] > 0, row["step"]
    for row1, row2 in zip(logged["dp1"], logged["dp2"], strict=True):  # the same figures, step by step
        assert row1["step"] == row2["step"]
        for key in figures:
            assert row2[key] == pytest.approx(row1[key], rel=1e-3, abs=1e-6), (row1["step"], key)


@pytest.mark.timeout(900)
def test_dp2_rank_killed_in_the_update_restarts_the_group_and_ends_bitwise_equal(
    tiny_assets, dp2_run, monkeypatch, caplog
):
    """The dp=2 run's config with one automatic restart (in this process): actor rank 1 SIGKILLs itself in
    step 2's update (`DAPO_FAULT`, which the local Ray's workers inherit), so the whole group restarts from
    checkpoint 1 (rank shards) by itself; the run ends with every rank's shard equal bit for bit to the
    uninterrupted run's."""
    monkeypatch.setenv("DAPO_FAULT", FAULT)
    run = _train(tiny_assets, "dp2_restarted", dp2=True, **{"trainer.max_restarts": 1})
    text = "\n".join(r.getMessage() for r in caplog.records)  # the flow run's log
    said = re.search(r"restart 1 of 1 .*a worker died at stage 'update_actor' of step 2 .*", text)
    assert said and "worker 'actor/1'" in said.group(0), text[-3000:]
    assert "resuming from checkpoint step 1" in said.group(0)
    print(f"dp=2 rank 1 killed in update_actor: {kill_to_commit_s(run, FAULT)} s to the next commit")
    for rank in (0, 1):
        name = f"model.rank{rank}.safetensors"
        a = load_file(str(dp2_run / "ckpt" / "step_3" / "actor" / name))
        b = load_file(str(run / "ckpt" / "step_3" / "actor" / name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (rank, k)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["fault/restarts"]) for r in rows] == [(1, 0.0), (2, 1.0), (3, 1.0)]


FAULT = "kill@update_actor#1:2"
"""Actor rank 1 dies in step 2's update."""


@pytest.mark.timeout(900)
def test_dp2_critic_gae_run_trains_like_dp1(tiny_assets):
    """GAE with the critic on: the critic group (FSDP2 over two ranks) gives dp=1's values at every step, the
    actor ends with dp=1's weights, and the critic checkpoints one shard per rank."""
    from flows.dapo_train import dapo_train

    gae = {"algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3, "trainer.save_freq": 3}
    runs = {}
    for name, extra in (("gae_dp1", {}), ("gae_dp2", DP2)):
        over = {**SHORT_RUN, **SIGNAL, **gae, **extra, "trainer.experiment_name": name}
        out = dapo_train(to_yaml(load_config(CONFIG, tiny_overrides(tiny_assets, **over))), name)
        assert out["train_step"] == 3
        runs[name] = Path(out["run_dir"])
    workers = json.loads((runs["gae_dp2"] / "workers.json").read_text())["workers"]
    assert sorted((w["role"], w["rank"]) for w in workers if w["role"] == "critic") == [
        ("critic", 0),
        ("critic", 1),
    ]
    one, two = RunStore(runs["gae_dp1"]), RunStore(runs["gae_dp2"])
    for step in (1, 2, 3):  # values after 0, 1 and 2 critic updates
        v1 = one.read_stage(step, "values").column("values").to_pylist()
        v2 = two.read_stage(step, "values").column("values").to_pylist()
        assert len(v1) == len(v2)
        for x, y in zip(v1, v2, strict=True):
            assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4), step
    assert any(abs(v) > 1e-4 for row in one.read_stage(3, "values").column("values").to_pylist() for v in row)
    w1, w2 = _weights(runs["gae_dp1"], 3), _weights(runs["gae_dp2"], 3)
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert diff < 1e-5, diff
    critic_dir = runs["gae_dp2"] / "ckpt" / "step_3" / "critic"
    assert sorted(p.name for p in critic_dir.glob("critic.rank*.tensors")) == [
        "critic.rank0.tensors",
        "critic.rank1.tensors",
    ]
