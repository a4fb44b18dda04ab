"""The replay-buffer step order end to end under real Prefect (the test run's shared server).

A tiny run (4 prompts × n=2 per step, a 1-layer model warmed up by 3 SFT steps) trains 3 global steps with
`trainer.parameter_sync_step=2`, once with in-process workers and once on a local Ray, and checks:
- the actor got 2 local updates per global step (stages `update_actor_p0/p1`; in-process also by counting
  calls);
- `training/off_policy/trajectory_staleness*` is logged every step and is >= 0;
- step 1 trains on data of weight version 0 (staleness 0); the batch of step k >= 2 was generated during step
  k−1 with the weights before step k−1's update, i.e. version k−2 = one step stale (staleness 1);
- the run store holds every committed stage; no prompt is left in flight; no group is trained twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo_core.config import load_config, to_yaml
from dapo_core.store import RunStore

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
PARTS = 2


def _overrides(tmp: Path, *, use_ray: bool, run: str) -> list[str]:
    data = tmp / "data"
    return [
        f"data.synthetic.out_dir={data}",
        f"data.train_files=[{data}/train.parquet]",
        f"data.val_files=[{data}/val.parquet]",
        "data.synthetic.num_train=64",
        "data.synthetic.num_val=8",
        "data.train_batch_size=4",
        "data.gen_batch_size=4",
        "data.max_response_length=16",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.model.tiny.hidden_size=64",
        "actor_rollout_ref.model.tiny.intermediate_size=64",
        "actor_rollout_ref.model.tiny.num_hidden_layers=1",
        "actor_rollout_ref.model.tiny.num_attention_heads=2",
        "actor_rollout_ref.model.tiny.num_key_value_heads=1",
        "actor_rollout_ref.model.tiny.head_dim=32",
        "actor_rollout_ref.model.sft.steps=3",
        "actor_rollout_ref.model.sft.batch_size=8",
        "algorithm.filter_groups.enable=false",
        "reward_model.overlong_buffer.len=4",
        f"trainer.models_dir={tmp / 'models'}",
        f"trainer.runs_dir={tmp / 'runs'}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.step_order=replay_buffer",
        f"trainer.parameter_sync_step={PARTS}",
        "trainer.test_freq=0",
        f"trainer.save_freq={STEPS}",
        "trainer.keep_rollouts_every=1",  # the checks read every step's stages (retention: test_retention)
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.use_ray={str(use_ray).lower()}",
        f"trainer.experiment_name={run}",
    ]


@pytest.fixture(scope="module")
def assets(prefect_home, tmp_path_factory):
    """Data and the tiny base model, built once by their Prefect flows."""
    from flows.base_model import base_model_flow
    from flows.prepare_data import prepare_data_flow

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("replay")
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", _overrides(tmp, use_ray=False, run="setup"))
    prepare_data_flow(to_yaml(cfg))
    base_model_flow(to_yaml(cfg))
    return tmp


def _train(tmp: Path, monkeypatch, *, use_ray: bool, run: str) -> tuple[dict, dict[int, dict], RunStore]:
    import flows.dapo_train as dt

    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", _overrides(tmp, use_ray=use_ray, run=run))
    out = dt.dapo_train(to_yaml(cfg), run)
    root = Path(out["run_dir"])
    metrics = {}
    for line in (root / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        metrics.setdefault(rec["step"], {}).update(rec)
    return out, metrics, RunStore(root)


def _check_run(out: dict, metrics: dict[int, dict], store: RunStore) -> None:
    assert out["train_step"] == STEPS
    # one synchronous refill at step 1, then one generation launched ahead per step except the last
    assert out["gen_step"] == 1 + (STEPS - 1)
    seen_uids: set[str] = set()
    for k in range(1, STEPS + 1):
        stages = set(store.committed_stages(k))
        # no old_log_prob_p<i>: each local update is one mini-batch (2 of 4 prompts a part), on-policy
        expected = {"batch", "advantage"} | {
            f"{s}_p{i}" for i in range(PARTS) for s in ("batch", "advantage", "update_actor")
        }
        if k < STEPS:
            expected |= {"prompts_ga", "generate_ga", "reward_ga"}
        if k == 1:
            expected |= {"prompts_g0", "generate_g0", "reward_g0"}
        assert expected <= stages, f"step {k}: missing {sorted(expected - stages)}"
        assert not any(s.startswith("update_actor_p") and s not in expected for s in stages)

        m = metrics[k]
        assert m["training/local_updates"] == PARTS
        for key in ("trajectory_staleness", "trajectory_staleness_worst", "trajectory_spans"):
            for stat in ("mean", "max", "min"):
                assert m[f"training/off_policy/{key}/{stat}"] >= 0, (k, key, stat)
        assert "training/off_policy/evicted_samples" in m

        batch = store.read_stage(k, "batch")
        versions = set(batch.column("weight_version").to_pylist())
        if k == 1:
            assert versions == {0}
            assert m["training/off_policy/trajectory_staleness/max"] == 0
        else:
            # generated during step k-1 with the weights before its update: one step stale
            assert versions == {k - 2}, (k, versions)
            assert m["training/off_policy/trajectory_staleness/min"] == 1
            assert m["training/off_policy/trajectory_staleness/max"] == 1
            ahead = store.read_stage(k - 1, "generate_ga")
            assert set(batch.column("uid").to_pylist()) == set(ahead.column("uid").to_pylist())
        uids = set(batch.column("uid").to_pylist())
        assert not uids & seen_uids, f"step {k} trains groups already trained"
        seen_uids |= uids
    inflight = [
        k for k, t in store.items("train", is_prompt=True) if t.get("status") in ("pending", "running")
    ]
    assert inflight == []
    assert store.checkpoints.latest_step() == STEPS


@pytest.fixture(scope="module")
def local_run(assets):
    """The uninterrupted in-process run, with every ActorWorker.update_actor call recorded."""
    from dapo_core.compute.workers import actor as actor_mod

    calls: list[int] = []
    original = actor_mod.ActorWorker.update_actor

    def counting(self, table, global_steps, *args):
        calls.append(int(global_steps))
        return original(self, table, global_steps, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(actor_mod.ActorWorker, "update_actor", counting)
        out, metrics, store = _train(assets, mp, use_ray=False, run="replay-local")
    yield out, metrics, store, calls
    store.close()


def test_replay_order_in_process(local_run):
    out, metrics, store, calls = local_run
    assert calls == [k for k in range(1, STEPS + 1) for _ in range(PARTS)]
    _check_run(out, metrics, store)


def test_replay_order_on_ray(assets, monkeypatch):
    pytest.importorskip("ray")
    out, metrics, store = _train(assets, monkeypatch, use_ray=True, run="replay-ray")
    try:
        _check_run(out, metrics, store)
    finally:
        store.close()


def test_replay_order_resumes_after_crash(assets, local_run, monkeypatch):
    """Crash in step 2's first local update (the rollouts for step 3 are in flight, checkpoint at step 1),
    resume: the in-flight prompts are re-issued and regenerated from their payloads with their original
    gen_step, the committed batch of step 2 is replayed, nothing is lost or trained twice, and the final
    weights are bitwise those of the uninterrupted run (same seeds, same uids)."""
    import flows.dapo_train as dt
    import flows.learn as learn

    original = learn.update_actor

    def crash_at_step_2(run_id, step, uri, part=None, **kwargs):
        if step == 2:
            raise RuntimeError("injected crash")
        return original(run_id, step, uri, part=part, **kwargs)

    run = "replay-crash"
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu.yaml",
        [*_overrides(assets, use_ray=False, run=run), "trainer.save_freq=1"],
    )
    monkeypatch.setattr(learn, "update_actor", crash_at_step_2)
    with pytest.raises(Exception, match="injected crash"):
        dt.dapo_train(to_yaml(cfg), run)
    root = assets / "runs" / run
    with RunStore(root) as store:
        assert store.checkpoints.latest_step() == 1
        ahead = store.read_stage(2, "prompts_ga")
        ahead_uids = set(ahead.column("uid").to_pylist())
        tags = store.get_many(sorted(ahead_uids))
        assert {t["status"] for t in tags.values()} == {"running"}  # generated, never collected
        batch2 = store.read_stage(2, "batch")
    monkeypatch.setattr(learn, "update_actor", original)
    out = dt.dapo_train(to_yaml(cfg), run)
    assert out["train_step"] == STEPS and out["gen_step"] == 1 + (STEPS - 1)
    with RunStore(root) as store:
        assert store.read_stage(2, "batch").equals(batch2)  # the committed batch is replayed
        regen = store.read_stage(2, "generate_gr0")
        assert set(regen.column("uid").to_pylist()) == ahead_uids
        assert set(regen.column("gen_step").to_pylist()) == {3}  # the seeds of its first launch
        assert set(regen.column("weight_version").to_pylist()) == {1}  # the checkpoint's weights
        batch3 = store.read_stage(3, "batch")
        assert set(batch3.column("uid").to_pylist()) == ahead_uids
        trained = [store.read_stage(k, "batch").column("uid").to_pylist() for k in range(1, STEPS + 1)]
        assert len({u for b in trained for u in b}) == sum(len(set(b)) for b in trained)  # nothing twice
        assert not [
            k for k, t in store.items("train", is_prompt=True) if t.get("status") in ("pending", "running")
        ]
        for _, t in store.items("train", is_prompt=False):  # every buffered trajectory still resolves
            store.read_uri(t["uri"])
        for k in range(1, STEPS + 1):
            assert {f"update_actor_p{i}" for i in range(PARTS)} <= set(store.committed_stages(k))
            assert store.read_stage(k, "batch").equals(local_run[2].read_stage(k, "batch")), (
                f"step {k} differs"
            )
        resumed = load_file(Path(store.checkpoints.load(STEPS)) / "actor" / "model.safetensors")
    uninterrupted = load_file(Path(local_run[2].checkpoints.load(STEPS)) / "actor" / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name
