"""`dapo plan`: the estimate checked by hand and against measured CPU peaks, the layouts of the 32B recipe,
LoRA's plan, the CPU plan, and the CLI.

Measured peaks come from `measure_actor_update` in a fresh Python process (the resident high-water mark,
reset after the weights are loaded, so memory freed by earlier tests cannot hide an allocation). The process
runs with glibc's mmap threshold fixed at 128 KiB: with its default, dynamic threshold, freed tensors stay in
the heap by chance, and the same update's high-water mark ranged over 1.1-1.7x the live peak from run to run;
fixed, every tensor above 128 KiB is returned when freed and the mark is the live peak the plan models, the
same in every run. Tolerance: measured / estimated within 0.7-1.6 (on CPU the packed forward's attention
materialises scores; the plan counts the packed pass's buffers at their budget). bench/bench_plan.py reports
the ratios per feature. The advice is tested in test_plan_advice.py, the push's plan in plan/test_sync.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dapo_core.compute.plan import (
    BUILTIN_SHAPES,
    EXIT_UNKNOWN_BUDGET,
    PlanError,
    gpu_budget_problem,
    make_plan,
    parse_bytes,
    resolve_shape,
)
from dapo_core.config import load_config, typed
from flows.cli import main
from tests.unit.dapo_core.compute.plan.support import (
    BIG_32B,
    CONFIGS,
    DS,
    LORA,
    MIXED,
    ROOT,
    SMALL,
    VERL_LORA,
    GiB,
)
from tests.unit.dapo_core.compute.plan.support import fsdp2 as _fsdp2

MEASURE = """
import json, sys, tempfile, torch
torch.set_num_threads(1)
from dapo_core.config import load_config, typed
from dapo_core.compute.models import build_tiny_model
from tests.helpers import measure_actor_update
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


SHARED = "actor_rollout_ref.model.use_shared_prompt"  # the rows of a group share their prompt (tiny default)


MEMORY_ON = [
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024",
]


def _measure(overrides: list[str], what: str = "measure_actor_update") -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE.replace("measure_actor_update", what), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(128 << 10)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "features",
    [[f"{SHARED}=false"], MEMORY_ON, [f"{SHARED}=true"], [f"{SHARED}=true", f"{MIXED}=bf16"], LORA],
    ids=["padded", "ckpt+packed+budget", "shared prompt", "shared prompt, bf16 autocast", "lora"],
)
def test_estimate_is_within_tolerance_of_the_measured_cpu_peak(features):
    r = _measure(SHAPE + features)
    ratio = r["measured"] / r["estimated"]
    assert 0.7 <= ratio <= 1.6, r


def test_rollout_estimate_is_within_tolerance_of_the_measured_cpu_peak():
    # HF engine: 32 prompts × n 4 = 128 rows of 64 + 192 tokens, KV cache, prefill and sampling tensors.
    r = _measure(SHAPE, "measure_rollout")
    assert r["rows"] == 128 and 0.7 <= r["measured"] / r["estimated"] <= 1.6, r


def test_memory_features_lower_the_estimate():
    cfg = typed(load_config(CONFIGS / "tiny_cpu.yaml", SHAPE))
    on = typed(load_config(CONFIGS / "tiny_cpu.yaml", SHAPE + MEMORY_ON))
    actor = next(r for r in make_plan(cfg).roles if r.role == "actor")
    actor_on = next(r for r in make_plan(on).roles if r.role == "actor")
    base = actor.rows[0].bytes  # the process itself (Python, torch), the same in both
    assert actor_on.total - base < (actor.total - base) / 2


def test_parameter_counts_match_the_published_models():
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings); Qwen2.5-32B: 32,763,876,352 (HF model cards).
    assert BUILTIN_SHAPES["Qwen2.5-0.5B"].num_params == 494_032_768
    assert BUILTIN_SHAPES["Qwen2.5-32B"].num_params == 32_763_876_352


def test_rows_can_be_checked_by_hand():
    # The one-process DeepSpeed engine of the 32B config (ZeRO-3, both offloads, bf16) on an 80 GiB GPU.
    cfg = typed(load_config(CONFIGS / "dapo_qwen2.5_32b.yaml", DS))
    plan = make_plan(cfg, gpu_mem=parse_bytes("80GiB"))
    s = plan.shape
    P = s.num_params
    actor = plan.roles[0]
    rows = {(r.phase, r.name): r.bytes for r in actor.rows}
    host = {(r.phase, r.name): r.bytes for r in actor.host_rows}
    # offload_optimizer: fp32 master, m, v and fp32 gradients (16 B per parameter) on the host.
    assert ("", "optimizer") not in rows and host[("", "optimizer")] == P * 16
    assert host[("", "weights")] == P * 2  # offload_param: the bf16 weights on the host
    # Checkpointed activations of one 22,528-token micro-batch, bf16: N·(layers·h + 2·(8h + 4kv + 4i))·2.
    per = 8 * 5120 + 4 * 1024 + 4 * 27648
    assert rows[("update", "activations (ckpt)")] == 22528 * (64 * 5120 + 2 * per) * 2
    # A push gathers every ZeRO-3 partition (P·2 bytes) and packs the tensors into one 512 MiB bucket that
    # rank 0 broadcasts to the rollout GPUs; the weights are bf16 already, so no tensor is cast.
    assert rows[("sync", "gathered weights")] == P * 2 and rows[("sync", "bucket")] == 512 << 20
    assert ("sync", "cast tensor") not in rows and ("sync", "shared bucket") not in rows
    assert actor.total == sum(r.bytes for r in actor.rows if not r.phase) + P * 2 + (512 << 20)
    assert plan.sync is not None and (plan.sync.kind, plan.sync.per_link) == ("broadcast", P * 2)
    rollout = plan.roles[-1]
    assert rollout.role == "rollout" and rollout.budget == int(0.8 * parse_bytes("80GiB"))
    assert rollout.rows[0].bytes == P * 2 // 4  # bf16 weights over tensor-parallel 4
    text = plan.render()
    assert "N·(layers·h + 2·(8h+4kv+4i))·b" in text and "offload_param" in text and "host RAM" in text


def test_recipe_layout_shards_over_128_gpus_and_says_what_does_not_fit(capsys):
    from dapo_core.compute.plan import run_plan

    fp32 = f"{MIXED}=fp32"
    cfg = _fsdp2(typed(load_config(CONFIGS / "dapo_qwen2.5_32b.yaml", [*DS, fp32])))
    plan = make_plan(cfg, gpu_mem=parse_bytes("80GiB"), host_mem=parse_bytes("1800GiB"))
    lay, P, V_h = plan.layout, plan.shape.num_params, plan.shape.embedding_params
    assert (lay.world, lay.dp, lay.tp, lay.replicas, lay.colocated) == (128, 128, 4, 32, True)
    rows = {(r.phase, r.name): r.bytes for r in plan.roles[0].rows}
    # float32 shards of weights, gradients and AdamW m, v: 1/128 each on every GPU.
    assert (rows[("", "weights")], rows[("", "gradients")], rows[("", "optimizer")]) == (
        P * 4 // 128,
        P * 4 // 128,
        P * 8 // 128,
    )
    # No load spike: each rank reads its rows of one tensor at a time into meta-built shards.
    assert rows[("load", "load")] == V_h * 4 // 128
    # float32 activations and logits of a 22,528-token micro-batch do not fit beside the rollout's weights.
    assert plan.gpu is not None and plan.gpu.fits() is False
    # The push: each rank all-gathers one tensor at a time in the rollout's bf16 (the largest, V·h, plus
    # its cast shard) and rank 0 packs it into a 512 MiB bucket; no process holds the whole model.
    assert rows[("sync", "gathered tensor")] == V_h * 2 + V_h * 2 // 128
    assert rows[("sync", "bucket")] == 512 << 20 and ("sync", "shared bucket") not in rows  # tp 4: broadcast
    rollout = plan.roles[-1]
    beside = {r.name: r.bytes for r in rollout.beside}
    assert beside == {
        "receive bucket": 512 << 20,
        "tensors copied out": (512 << 20) + 2 * V_h * 2,
        "weight group": max(512 << 20, V_h * 2),
    }
    # Host RAM per node: Ray (+ the driver on node 0) and each process's peak; vLLM sleeps at level 2, so
    # no row holds a copy of the weights.
    from dapo_core.compute.plan import DRIVER_BYTES, NCCL_BUFFER_BYTES, PROCESS_BYTES, RAY_NODE_BYTES

    actor_host = PROCESS_BYTES["cuda"] + NCCL_BUFFER_BYTES
    rollout_host = actor_host + beside["weight group"]
    assert [r.host_total for r in plan.roles] == [actor_host, rollout_host]
    node0, node1 = plan.hosts
    assert node0.total == RAY_NODE_BYTES + DRIVER_BYTES + 8 * (actor_host + rollout_host)
    assert node1.total == node0.total - DRIVER_BYTES
    assert [r.name for r in node1.rows] == ["Ray", "actor × 8", "rollout × 8"]
    # One push per step: each rank's share of the all-gather, then rank 0's broadcast of P·2 bytes.
    sync = plan.sync
    assert sync is not None and (sync.kind, sync.links, sync.receivers) == ("broadcast", 1, 32)
    lines = {x.name: x for x in sync.lines}
    assert lines["all-gather per rank"].bytes == 127 * P * 2 // 128
    assert lines["bytes per push"].bytes == P * 2 == sync.per_link
    assert sync.seconds == pytest.approx((127 * P * 2 / 128 + P * 2) / 25e9)
    assert run_plan(cfg, "plan", gpu_mem="80GiB", host_mem="1800GiB") == 2
    err = capsys.readouterr().err
    assert "no setting of the memory keys fits (largest: actor update: activations (ckpt)" in err
    # On 141 GiB GPUs (H200) the same layout fits.
    assert not make_plan(cfg, gpu_mem=parse_bytes("141GiB"), host_mem=parse_bytes("1800GiB")).failures()
    # bf16 mixed precision (the config's, verl's default) halves the passes: 80 GiB GPUs fit.
    bf16 = _fsdp2(typed(load_config(CONFIGS / "dapo_qwen2.5_32b.yaml", DS)))
    mixed = make_plan(bf16, gpu_mem=parse_bytes("80GiB"), host_mem=parse_bytes("1800GiB"))
    half = {(r.phase, r.name): r.bytes for r in mixed.roles[0].rows}
    assert half[("update", "activations (ckpt)")] * 2 == rows[("update", "activations (ckpt)")]
    assert half[("", "weights")] == rows[("", "weights")]  # the shards stay float32
    assert not mixed.failures()


@pytest.mark.parametrize("name", BIG_32B)
def test_32b_configs_state_the_recipe_layout(name, capsys):
    cfg = typed(load_config(CONFIGS / name, []))
    lay = make_plan(cfg, gpu_mem=parse_bytes("80GiB")).layout
    assert (lay.nnodes, lay.per_node, lay.dp, lay.tp, lay.replicas, lay.colocated) == (
        16,
        8,
        128,
        4,
        32,
        True,
    )
    flags = ["--host-mem", "1800GiB"]
    assert main(["plan", "--config", str(CONFIGS / name), "--gpu-mem", "80GiB", *flags]) == 0  # bf16
    assert main(["plan", "--config", str(CONFIGS / name), "--gpu-mem", "80GiB", *flags, f"{MIXED}=fp32"]) == 2
    assert "GPU shared by all roles needs" in capsys.readouterr().err
    assert (
        main(["plan", "--config", str(CONFIGS / name), "--gpu-mem", "141GiB", *flags, f"{MIXED}=fp32"]) == 0
    )


@pytest.mark.parametrize(
    ("targets", "exclude"),
    [("all-linear", None), (["q_proj", "v_proj", "lm_head"], None), ("all-linear", ["down_proj"])],
)
def test_planned_adapters_are_the_ones_peft_builds(targets, exclude, tmp_path):
    from dapo_core.compute.lora import LoraSpec, add_lora
    from dapo_core.compute.models import build_tiny_model, load_model
    from dapo_core.compute.plan.shape import lora_shape

    untied = "actor_rollout_ref.model.tiny.tie_word_embeddings=false"  # a tied lm_head is refused
    cfg = typed(load_config(CONFIGS / "tiny_cpu.yaml", [*LORA, untied]))
    model = cfg.actor_rollout_ref.model
    model.target_modules, model.exclude_modules = targets, exclude
    folder = build_tiny_model(str(tmp_path), dict(vars(model.tiny)), seed=0)
    spec = LoraSpec.from_model_config(model)
    assert spec is not None
    built = add_lora(load_model(folder), spec)
    trained = sum(p.numel() for p in built.parameters() if p.requires_grad)
    planned = lora_shape(resolve_shape(cfg), model)
    assert planned is not None and planned.params == trained


def test_verl_lora_override_on_the_32b_recipe_plans_a_smaller_actor_and_no_reference(capsys):
    """The 32B recipe (fsdp2 over 128 GPUs) with verl's LoRA keys: `dapo config` and `dapo plan` pass; the
    actor's gradients and AdamW state are the adapters' (P_lora = Σ r·(in + out) over q, k, v, o, gate, up,
    down of 64 layers), the frozen base stays float32 shards, and with KL on the LoRA plan has no reference
    role while full fine-tuning has one."""
    path = str(CONFIGS / "dapo_qwen2.5_32b.yaml")
    flags = ["--gpu-mem", "80GiB", "--host-mem", "1800GiB"]
    assert main(["config", "--config", path, *VERL_LORA]) == 0
    assert main(["plan", "--config", path, *flags, *VERL_LORA]) == 0
    out = capsys.readouterr().out
    assert "P_lora = Σ r·(in + out) = 536,870,912" in out and "[ref]" not in out
    kl = ["actor_rollout_ref.actor.use_kl_loss=true"]
    gpu, host = parse_bytes("80GiB"), parse_bytes("1800GiB")
    full = make_plan(typed(load_config(path, kl)), gpu_mem=gpu, host_mem=host)
    lora = make_plan(typed(load_config(path, kl + VERL_LORA)), gpu_mem=gpu, host_mem=host)
    P, A = full.shape.num_params, 64 * 64 * (2 * 10240 + 2 * 6144 + 3 * 32768)
    assert A == 536_870_912
    rows = {(r.phase, r.name): r.bytes for r in lora.roles[0].rows}
    assert rows[("", "weights")] == (P + A) * 4 // 128
    assert (rows[("", "gradients")], rows[("", "optimizer")]) == (A * 4 // 128, A * 8 // 128)
    assert [r.role for r in full.roles] == ["actor", "ref", "rollout"]
    assert [r.role for r in lora.roles] == ["actor", "rollout"]
    ref = full.roles[1]
    held = sum(r.bytes for r in ref.rows if not r.phase)
    saving = f"no ref role (a reference model would hold {held / GiB:.2f} GiB per GPU throughout"
    assert any(saving in a for a in lora.assumptions), lora.assumptions
    assert lora.roles[0].total < full.roles[0].total - 4 * GiB
    # on the shared GPU the passes never overlap: the saving is the reference's shards, and the actor's
    assert full.gpu is not None and lora.gpu is not None and lora.gpu.total < full.gpu.total - held
    # the push carries the merged weights: the same bytes per link as full fine-tuning
    assert (
        lora.sync is not None and full.sync is not None and lora.sync.per_link == full.sync.per_link == P * 2
    )


def test_lora_on_deepspeed_plans_adapter_gradients_and_optimizer_and_bf16_frozen_weights():
    """The 32B config on the one-process DeepSpeed engine (ZeRO-2, bf16) with verl's LoRA keys: the module
    holds the frozen base and the adapters in bf16, and the gradients and fp32 master + AdamW state are the
    adapters' only; with both offloads (ZeRO-3) the host's optimizer row is the adapters' too."""
    path = str(CONFIGS / "dapo_qwen2.5_32b.yaml")
    gpu, host = parse_bytes("80GiB"), parse_bytes("1800GiB")
    z2 = [o for o in DS if "offload" not in o and "zero_stage" not in o]
    z2.append("actor_rollout_ref.actor.deepspeed.zero_stage=2")
    full = make_plan(typed(load_config(path, z2)), gpu_mem=gpu, host_mem=host)
    lora = make_plan(typed(load_config(path, z2 + VERL_LORA)), gpu_mem=gpu, host_mem=host)
    P, A = full.shape.num_params, 536_870_912
    got = {r.name: r.bytes for r in lora.roles[0].rows if not r.phase}
    assert got == {"weights": (P + A) * 2, "gradients": A * 2, "optimizer": A * 12}
    assert {r.name: r.bytes for r in full.roles[0].rows if not r.phase}["optimizer"] == P * 12
    offloaded = make_plan(typed(load_config(path, DS + VERL_LORA)), gpu_mem=gpu, host_mem=host)
    rows = [r for r in offloaded.roles[0].host_rows if r.name == "optimizer"]
    assert [r.bytes for r in rows] == [A * 16], rows


def test_sizes_and_shapes_fail_with_the_fix():
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes("141G") == 141 << 30
    with pytest.raises(PlanError, match="--gpu-mem 'lots'"):
        parse_bytes("lots")
    cfg = typed(
        load_config(CONFIGS / "dapo_qwen2.5_32b.yaml", [*DS, "actor_rollout_ref.model.path=/no/Model-9B"])
    )
    with pytest.raises(PlanError, match="--model-config"):
        resolve_shape(cfg)


def test_weights_are_counted_once_without_offload_param():
    # ZeRO-3 without offload_param at dp=1: the whole bf16 model is on the GPU once; the load pass (DeepSpeed
    # moving the module before partitioning) stands alone instead of adding a second copy.
    cfg = typed(
        load_config(CONFIGS / BIG_32B[0], [*SMALL, "actor_rollout_ref.actor.deepspeed.offload_param=false"])
    )
    actor = make_plan(cfg, gpu_mem=parse_bytes("80GiB")).roles[0]
    P = actor_p = BUILTIN_SHAPES["Qwen2.5-0.5B"].num_params
    weights = [r for r in actor.rows if r.name == "weights"]
    assert [r.bytes for r in weights] == [P * 2] and actor_p
    held = sum(r.bytes for r in actor.rows if not r.phase)
    passes = {}
    for r in actor.rows:
        if r.phase and r.phase != "load":
            passes[r.phase] = passes.get(r.phase, 0) + r.bytes
    assert actor.total == held + max(passes.values())  # the load pass (P·2) is not added on top


def test_the_reference_can_be_bf16_and_the_worker_honours_it(tmp_path):
    import torch

    from dapo_core.compute.models import build_tiny_model
    from dapo_core.compute.workers.actor import RefWorker

    fp32 = typed(load_config(CONFIGS / BIG_32B[0], [*SMALL, "actor_rollout_ref.actor.use_kl_loss=true"]))
    bf16 = typed(
        load_config(
            CONFIGS / BIG_32B[0],
            [*SMALL, "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.dtype=bfloat16"],
        )
    )
    w32 = next(r for r in make_plan(fp32).roles if r.role == "ref").rows[0]
    w16 = next(r for r in make_plan(bf16).roles if r.role == "ref").rows[0]
    assert w32.bytes == 2 * w16.bytes
    tiny = typed(load_config(CONFIGS / "tiny_cpu.yaml", []))
    folder = build_tiny_model(str(tmp_path), dict(vars(tiny.actor_rollout_ref.model.tiny)), seed=0)
    ref = RefWorker(str(folder), pad_token_id=0, temperature=1.0, dtype="bfloat16")
    assert {p.dtype for p in ref.engine.model.parameters()} == {torch.bfloat16}


def test_the_rollout_row_is_what_vllm_needs_not_its_reservation():
    few = [
        *SMALL,
        "data.train_batch_size=2",
        "data.gen_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
    ]
    cfg = typed(load_config(CONFIGS / BIG_32B[0], few))
    s = BUILTIN_SHAPES["Qwen2.5-0.5B"]
    gpu = parse_bytes("80GiB")
    rollout = make_plan(cfg, gpu_mem=gpu).roles[-1]
    kv = {r.name: r.bytes for r in rollout.rows}["kv cache"]
    # 4 rows over the 2 replicas of 8 GPUs / tp 4: 2 sequences of T = 22,528 tokens each; per token
    # 2·layers·ceil(kv_heads/tp)·head_dim·2 B (2 kv heads, tp 4).
    assert kv == 2 * 22528 * 2 * 24 * 1 * 64 * 2
    assert rollout.total < rollout.budget == int(0.8 * gpu)
    assert rollout.rows[0].bytes == s.num_params * 2 // 4
    unknown = make_plan(cfg).roles[-1]  # no GPU size: the same need, no reservation
    assert unknown.total == rollout.total and unknown.budget is None


def test_unknown_gpu_budget_is_said_and_train_refuses(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["--config", str(CONFIGS / BIG_32B[0]), *DS]
    assert main(["plan", *args]) == EXIT_UNKNOWN_BUDGET
    assert "unknown budget" in capsys.readouterr().err
    assert main(["train", *args]) == 2
    assert "--gpu-mem 80GiB" in capsys.readouterr().err
    cfg = typed(load_config(CONFIGS / BIG_32B[0], DS))
    assert gpu_budget_problem(cfg, None) and gpu_budget_problem(cfg, "80GiB") is None
    assert gpu_budget_problem(typed(load_config(CONFIGS / "tiny_cpu.yaml", [])), None) is None


def test_cpu_plan_is_the_resident_memory_of_each_process():
    from dapo_core.compute.plan import DRIVER_BYTES, PROCESS_BYTES, RAY_NODE_BYTES

    plan = make_plan(typed(load_config(CONFIGS / "tiny_cpu.yaml", [])), host_mem=parse_bytes("24GiB"))
    assert [r.role for r in plan.roles] == ["actor", "rollout"]
    for role in plan.roles:
        assert role.rows[0].name == "process" and role.rows[0].bytes == PROCESS_BYTES["cpu"]
    (host,) = plan.hosts
    assert host.total == RAY_NODE_BYTES + DRIVER_BYTES + sum(r.total for r in plan.roles)
    assert host.fits() is True
    # The push's pass: the actor packs into its bucket and the /dev/shm bucket the rollout maps; the rollout
    # copies one bucket's tensors out. A bucket's resident pages are at most P·4 B (+ alignment) here.
    s, sync = plan.shape, plan.sync
    fill = s.num_params * 4 + 64 * s.num_tensors
    assert sync is not None and sync.kind == "same_device" and fill < 512 << 20
    actor, rollout = ({(r.phase, r.name): r.bytes for r in role.rows} for role in plan.roles)
    assert actor[("sync", "bucket")] == actor[("sync", "shared bucket")] == fill
    assert rollout[("sync", "receive bucket")] == fill
    assert rollout[("sync", "tensors copied out")] == fill + 2 * s.largest_params * 4


def test_host_ram_problem_refuses_a_cpu_run_that_cannot_fit_and_its_change_fits():
    from dapo_core.compute.plan import host_ram_problem

    big = [
        "actor_rollout_ref.model.tiny.hidden_size=1024",
        "actor_rollout_ref.model.tiny.intermediate_size=4096",
        "actor_rollout_ref.model.tiny.num_hidden_layers=8",
    ]
    cfg = typed(load_config(CONFIGS / "tiny_cpu.yaml", big))
    assert host_ram_problem(cfg, parse_bytes("64GiB")) is None
    msg = host_ram_problem(cfg, parse_bytes("7GiB"))
    assert msg is not None and "is available" in msg and "Change: " in msg
    for change in msg.split("Change: ", 1)[1].split(" (`dapo plan")[0].split("; or "):
        fixed = typed(load_config(CONFIGS / "tiny_cpu.yaml", big + change.split()))
        assert host_ram_problem(fixed, parse_bytes("7GiB")) is None, change
    assert host_ram_problem(typed(load_config(CONFIGS / BIG_32B[0], DS)), 1) is None  # a GPU run


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
    args += ["--gpu-mem", "80GiB", *DS]
    assert main(args) == 0
    assert "P=494,032,768 parameters" in capsys.readouterr().out
