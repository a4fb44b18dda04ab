"""A LoRA run end to end on the tiny model (in-process workers): it learns through merged weight pushes, the
reference comes from the actor with its adapters off (no reference worker), checkpoints hold the adapter, and
a run killed inside step 3 and resumed ends bitwise equal to the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_core.config import load_config, to_yaml
from tests.integration.conftest import (
    CONFIG,
    SHORT_RUN,
    kill_and_resume,
    tiny_overrides,
    train_cmd,
    train_here,
)

pytestmark = pytest.mark.slow

LORA_RUN = {
    **SHORT_RUN,
    "trainer.keep_rollouts_every": 0,
    "actor_rollout_ref.model.lora_rank": 8,
    "actor_rollout_ref.model.lora_alpha": 16,
    "actor_rollout_ref.actor.optim.lr": 1e-3,
    "actor_rollout_ref.actor.use_kl_loss": "true",
    "actor_rollout_ref.actor.kl_loss_coef": 0.01,
}
"""A 3-step in-process run, rank-8 adapters on every linear layer, with the KL loss (the ref stage runs)."""


def _metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    return [json.loads(ln) for ln in lines if ln.strip()]


def test_lora_run_learns_without_ref_worker_and_resumes_bitwise(tiny_assets, tmp_path):
    import torch
    from safetensors.torch import load_file

    from dapo_core.compute.lora import ADAPTER_SUBDIR, ADAPTER_WEIGHTS
    from dapo_core.compute.lora_checkpoint import is_adapter_folder, merge_into
    from flows.dapo_train import dapo_train

    cfg = load_config(CONFIG, tiny_overrides(tiny_assets, **LORA_RUN, **{"trainer.experiment_name": "lora"}))
    out = dapo_train(to_yaml(cfg), "lora")
    assert out["train_step"] == 3
    run = Path(out["run_dir"])
    actor = run / "ckpt" / "step_3" / "actor"

    # the checkpoint holds the adapter, not the model; merged into the base (as evaluation and the exports
    # do), it differs from the base on the adapted layers only, under the base model's names
    assert is_adapter_folder(actor) and not (actor / "model.safetensors").exists()
    base = load_file(str(tiny_assets / "models" / "tiny_base" / "model.safetensors"))
    merged = load_file(str(merge_into(actor, tmp_path / "merged") / "model.safetensors"))
    assert merged.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed), sorted(changed)[:5]
    assert all(torch.equal(base[k], merged[k]) for k in base if "norm" in k or "embed" in k)
    adapter = load_file(str(actor / ADAPTER_SUBDIR / ADAPTER_WEIGHTS))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)

    # the ref stage ran in the actor (no reference worker), and the KL between policy and base is logged
    rows = _metrics(run)
    assert rows, f"no metrics in {run}"
    assert any("actor/kl_loss" in r for r in rows)
    roles = {w["role"] for w in json.loads((run / "workers.json").read_text())["workers"]}
    assert "ref" not in roles and "actor" in roles, roles
    # every push carries the merged model: the base model's bytes, no adapter tensor on top
    sync = [r["weight_sync/bytes"] for r in rows if "weight_sync/bytes" in r]
    assert len(sync) == 3 and set(sync) == {float(sum(t.numel() * t.element_size() for t in base.values()))}

    # a run killed inside step 3 and resumed: the same adapter and merged weights, bit for bit
    resumed = tiny_assets / "runs" / "lora_resumed"
    ov = tiny_overrides(tiny_assets, **LORA_RUN, **{"trainer.experiment_name": "lora_resumed"})
    kill_and_resume(
        train_cmd(ov),
        resumed,
        "step_000003/generate_g0.manifest.json",
        resume=lambda: train_here(ov),
        reference=run,
    )
    again = load_file(str(resumed / "ckpt" / "step_3" / "actor" / ADAPTER_SUBDIR / ADAPTER_WEIGHTS))
    assert again.keys() == adapter.keys()
    assert all(torch.equal(again[k], adapter[k]) for k in adapter)
