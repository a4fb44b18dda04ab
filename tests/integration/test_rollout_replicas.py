"""Two rollout replicas in the real dapo-train flow (`trainer.n_gpus_per_node=2` on CPU: two processes per
node, so two HF engines): the run learns exactly as with one replica, every generation stage is committed as
two shares plus a row selection, and the replicas are named Ray actors that received every weight version.

The actor still trains on one process here: these runs compare the rollout side only (the data-parallel actor
is tested with the worker groups)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from safetensors.torch import load_file

from dapo_core.config import load_config, to_yaml
from tests.integration.conftest import CONFIG, tiny_overrides

pytestmark = pytest.mark.slow

STEPS = {
    "trainer.total_training_steps": 2,
    "trainer.save_freq": 2,
    "trainer.test_freq": 2,
    "trainer.val_before_train": "false",
    "algorithm.filter_groups.enable": "false",
}


def _run(root: Path, name: str, **extra: str) -> Path:
    from flows.dapo_train import dapo_train

    cfg = load_config(CONFIG, tiny_overrides(root, **{**STEPS, "trainer.experiment_name": name, **extra}))
    out = dapo_train(to_yaml(cfg), name)
    assert out["train_step"] == 2
    return Path(out["run_dir"])


def _same_rows(a: pa.Table, b: pa.Table) -> None:
    """Every column equal, in the same row order; the sampled tokens' log-probs to float precision (a share
    pads its prompts to its own longest one, which moves the last bits of the logits)."""
    assert a.column_names == b.column_names
    for col in a.column_names:
        if col != "rollout_log_probs":
            assert a.column(col).equals(b.column(col)), col
    la = np.concatenate(a.column("rollout_log_probs").to_numpy(zero_copy_only=False))
    lb = np.concatenate(b.column("rollout_log_probs").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)


@pytest.mark.timeout(900)
def test_two_replicas_on_ray_train_bitwise_as_one_in_process(tiny_assets):
    from dapo_core.store import RunStore

    one = _run(tiny_assets, "rep1", **{"trainer.use_ray": "false"})
    two = _run(tiny_assets, "rep2", **{"trainer.use_ray": "true", "trainer.n_gpus_per_node": "2"})

    a = load_file(str(one / "ckpt" / "step_2" / "actor" / "model.safetensors"))
    b = load_file(str(two / "ckpt" / "step_2" / "actor" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k  # same rows generated, so the same updates, bit for bit

    s1, s2 = RunStore(one), RunStore(two)
    try:
        for step in (1, 2):
            g1, g2 = s1.read_stage(step, "generate_g0"), s2.read_stage(step, "generate_g0")
            _same_rows(g1, g2)
            assert set(g2.column("weight_version").to_pylist()) == {step - 1}
            shares = [s2.read_stage(step, f"generate_g0_r{i}of2") for i in (0, 1)]
            assert sum(t.num_rows for t in shares) == g2.num_rows and all(t.num_rows for t in shares)
            assert not set(shares[0].column("uid").to_pylist()) & set(shares[1].column("uid").to_pylist())
            assert s2.manifest(step, "generate_g0")["selection"]
            assert "generate_g0_r0of2" not in s1.committed_stages(step)
        _same_rows(s1.read_stage(2, "val_generate"), s2.read_stage(2, "val_generate"))
        assert s2.is_committed(2, "val_generate_r1of2")
    finally:
        s1.close()
        s2.close()
    m1 = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    for r1, r2 in zip(m1, m2, strict=True):
        for key in ("response_length/gen_mean", "perf/gen_tokens", "critic/score/mean", "actor/pg_loss"):
            assert r1.get(key) == r2.get(key), key
    workers = json.loads((two / "workers.json").read_text())["workers"]
    replicas = sorted((w["rank"], w["name"]) for w in workers if w["role"] == "rollout")
    assert replicas == [(0, "rollout-0"), (1, "rollout-1")], workers
    assert all(w["node_id"] for w in workers if w["role"] == "rollout")


@pytest.mark.timeout(900)
def test_replay_order_with_two_replicas_generates_ahead_and_trains_as_one(tiny_assets):
    """The replay-buffer order launches step k+1's generation on both replicas and pushes weights after the
    update while it may still run: the push waits for it, the rows carry the version that made them, and the
    run ends with the weights of the one-replica run."""
    from dapo_core.store import RunStore

    order = {"trainer.step_order": "replay_buffer", "trainer.test_freq": "-1"}
    one = _run(tiny_assets, "replay1", **order, **{"trainer.use_ray": "false"})
    two = _run(tiny_assets, "replay2", **order, **{"trainer.use_ray": "true", "trainer.n_gpus_per_node": "2"})
    a = load_file(str(one / "ckpt" / "step_2" / "actor" / "model.safetensors"))
    b = load_file(str(two / "ckpt" / "step_2" / "actor" / "model.safetensors"))
    for k in a:
        assert (a[k] == b[k]).all(), k
    s1, s2 = RunStore(one), RunStore(two)
    try:
        gens = [s for s in s2.committed_stages(1) + s2.committed_stages(2) if s.startswith("generate_g")]
        shares = [s for s in gens if "_r" in s and s.endswith("of2")]
        assert shares, gens  # generated by both replicas
        for step in (1, 2):
            for stage in s1.committed_stages(step):
                if stage.startswith("generate_g"):
                    _same_rows(s1.read_stage(step, stage), s2.read_stage(step, stage))
    finally:
        s1.close()
        s2.close()


@pytest.mark.timeout(900)
def test_a_run_killed_between_two_shares_resumes_bitwise_and_keeps_the_committed_share(tiny_assets):
    """SIGKILL the training process once replica 0 committed its share of step 2's generation: the resumed
    run keeps that share (made with the checkpoint's weights), generates the other and ends with the weights
    of an uninterrupted two-replica run, bit for bit."""
    import os
    import subprocess
    import sys

    from tests.integration.conftest import kill_at

    common = {
        **STEPS,
        "trainer.save_freq": 1,
        "trainer.test_freq": -1,
        "trainer.use_ray": "false",
        "trainer.n_gpus_per_node": 2,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[2]

    def cmd(name: str) -> list[str]:
        ov = tiny_overrides(tiny_assets, **{**common, "trainer.experiment_name": name})
        return [sys.executable, "-m", "flows.cli", "train", "--flow-only", "--config", str(CONFIG), *ov]

    subprocess.run(cmd("rep-straight"), check=True, env=env, cwd=root, capture_output=True)
    run = tiny_assets / "runs" / "rep-resumed"
    share = run / "step_000002" / "generate_g0_r0of2.manifest.json"
    victim = subprocess.Popen(
        cmd("rep-resumed"), env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    kill_at(victim, share)
    assert (run / "ckpt" / "latest").read_text().strip() == "1"
    kept = share.read_bytes()
    done = subprocess.run(cmd("rep-resumed"), env=env, cwd=root, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert share.read_bytes() == kept  # the committed share was replayed, not generated again
    a = load_file(
        str(tiny_assets / "runs" / "rep-straight" / "ckpt" / "step_2" / "actor" / "model.safetensors")
    )
    b = load_file(str(run / "ckpt" / "step_2" / "actor" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
