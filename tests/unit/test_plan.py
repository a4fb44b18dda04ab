"""`dapo plan`: the per-GPU memory estimate, checked by hand, against measured CPU peaks, and through the CLI.

Measured peaks come from `measure_actor_update` in a fresh Python process (the resident high-water mark,
reset after the weights are loaded, so memory freed by earlier tests cannot hide an allocation). Tolerance:
measured / estimated within 0.75-1.6. Seen on the 2-core machine: 1.07-1.17 (padded and packed) in one run,
1.37 (packed + budget) in a clean-clone CI run: the resident high-water mark carries allocator slack that
varies from run to run, and on CPU the packed forward's attention materialises scores that the estimate (made
for CUDA's fused kernels) leaves out, so it errs low. bench/bench_plan.py reports the ratios per feature.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_core.compute.plan import (
    BUILTIN_SHAPES,
    PlanError,
    make_plan,
    parse_bytes,
    resolve_shape,
)
from dapo_core.config import load_config, typed
from flows.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
BIG_32B = ["dapo_qwen2.5_32b.yaml", "dapo_wo_ds_qwen2.5_32b.yaml", "dapo_early_qwen2.5_32b.yaml"]

MEASURE = """
import json, sys, tempfile, torch
torch.set_num_threads(1)
from dapo_core.config import load_config, typed
from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.plan import measure_actor_update
cfg = typed(load_config("configs/tiny_cpu.yaml", sys.argv[1:]))
tiny = {k: v for k, v in vars(cfg.actor_rollout_ref.model.tiny).items()}
folder = build_tiny_model(tempfile.mkdtemp(), tiny, seed=0)
print(json.dumps(measure_actor_update(cfg, str(folder))))
"""

SHAPE = [
    "actor_rollout_ref.model.tiny.hidden_size=256",
    "actor_rollout_ref.model.tiny.intermediate_size=1024",
    "actor_rollout_ref.model.tiny.num_hidden_layers=4",
    "actor_rollout_ref.model.tiny.max_position_embeddings=512",
    "data.max_prompt_length=64",
    "data.max_response_length=192",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
]
MEMORY_ON = [
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024",
]


def _measure(overrides: list[str]) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("features", [[], MEMORY_ON], ids=["padded", "ckpt+packed+budget"])
def test_estimate_is_within_tolerance_of_the_measured_cpu_peak(features):
    r = _measure(SHAPE + features)
    ratio = r["measured"] / r["estimated"]
    assert 0.75 <= ratio <= 1.6, r


def test_memory_features_lower_the_estimate():
    cfg = typed(load_config(CONFIGS / "tiny_cpu.yaml", SHAPE))
    on = typed(load_config(CONFIGS / "tiny_cpu.yaml", SHAPE + MEMORY_ON))
    actor = next(r for r in make_plan(cfg).roles if r.role == "actor")
    actor_on = next(r for r in make_plan(on).roles if r.role == "actor")
    assert actor_on.total < actor.total / 2


def test_parameter_counts_match_the_published_models():
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings); Qwen2.5-32B: 32,763,876,352 (HF model cards).
    assert BUILTIN_SHAPES["Qwen2.5-0.5B"].num_params == 494_032_768
    assert BUILTIN_SHAPES["Qwen2.5-32B"].num_params == 32_763_876_352


def test_rows_can_be_checked_by_hand():
    cfg = typed(load_config(CONFIGS / "dapo_qwen2.5_32b.yaml", []))
    plan = make_plan(cfg, gpu_mem=parse_bytes("80GiB"))
    s = plan.shape
    actor = {(r.phase, r.name): r.bytes for r in plan.roles[0].rows}
    # ZeRO-3 with both offloads: nothing of the optimizer or gradients on the GPU.
    assert actor[("", "gradients")] == 0 and actor[("", "optimizer")] == 0
    # Checkpointed activations of one 22,528-token micro-batch, bf16: N·(layers·h + 2·(8h + 4kv + 4i))·2.
    per = 8 * 5120 + 4 * 1024 + 4 * 27648
    assert actor[("update", "activations (ckpt)")] == 22528 * (64 * 5120 + 2 * per) * 2
    rollout = plan.roles[-1]
    assert rollout.role == "rollout" and rollout.budget == int(0.8 * parse_bytes("80GiB"))
    assert rollout.rows[0].bytes == s.num_params * 2 // 4  # bf16 weights over tensor-parallel 4
    text = plan.render()
    assert "N·(layers·h + 2·(8h+4kv+4i))·b" in text and "offload_param" in text


def test_sizes_and_shapes_fail_with_the_fix():
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes("141G") == 141 << 30
    with pytest.raises(PlanError, match="--gpu-mem 'lots'"):
        parse_bytes("lots")
    cfg = typed(load_config(CONFIGS / "dapo_qwen2.5_32b.yaml", ["actor_rollout_ref.model.path=/no/Model-9B"]))
    with pytest.raises(PlanError, match="--model-config"):
        resolve_shape(cfg)


@pytest.mark.parametrize("name", BIG_32B)
def test_32b_configs_plan_and_fit_80gib(name, capsys):
    assert main(["plan", "--config", str(CONFIGS / name), "--gpu-mem", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "[actor]" in out and "[rollout]" in out and "DOES NOT FIT" not in out


def test_plan_names_the_role_and_the_knob_when_it_does_not_fit(capsys):
    args = ["--config", str(CONFIGS / BIG_32B[0]), "--gpu-mem", "80GiB"]
    off = ["actor_rollout_ref.model.enable_gradient_checkpointing=false"]
    assert main(["plan", *args, *off]) == 2
    err = capsys.readouterr().err
    assert "role actor needs" in err and "enable_gradient_checkpointing=true" in err
    # `dapo train` runs the plan first and refuses before any data, model or Prefect work.
    assert main(["train", *args, *off]) == 2
    err = capsys.readouterr().err
    assert "refusing to start a run that cannot fit" in err


def test_model_config_flag_reads_a_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 896,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "intermediate_size": 4864,
                "tie_word_embeddings": True,
                "torch_dtype": "bfloat16",
            }
        )
    )
    args = ["plan", "--config", str(CONFIGS / BIG_32B[0]), "--model-config", str(tmp_path / "config.json")]
    assert main(args) == 0
    assert "P=494,032,768 parameters" in capsys.readouterr().out
