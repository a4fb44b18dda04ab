"""`dapo plan`'s advice (dapo_core.compute.plan_advice): every refusal's advice is applied through the real
config loader and re-planned, and it must fit; LoRA is offered only engines that build adapters; a combined
change is trimmed; the CLI names the role and the change."""

from __future__ import annotations

import pytest

from dapo_core.compute.plan import (
    advise,
    make_plan,
    parse_bytes,
)
from dapo_core.compute.plan_advice import apply_overrides
from dapo_core.config import load_config, typed
from flows.cli import main
from tests.unit.dapo_core.compute.plan.support import (
    BIG_32B,
    CONFIGS,
    DS,
    MIXED,
    SMALL,
    VERL_LORA,
)
from tests.unit.dapo_core.compute.plan.support import fsdp2 as _fsdp2


def test_lora_advice_offers_only_engines_that_build_adapters():
    from dapo_core.compute.plan_advice import candidates

    gpu = ["trainer.device=cuda", "trainer.nnodes=1", "actor_rollout_ref.actor.strategy=torch"]

    def strategies(overrides: list[str]) -> set[str]:
        cfg = typed(load_config(CONFIGS / "dapo_qwen2.5_32b.yaml", gpu + overrides))
        options = (o for cand in candidates(cfg, "actor", 40) for opts in cand for o in opts)
        return {o.rsplit("=", 1)[1] for o in options if o.startswith("actor_rollout_ref.actor.strategy=")}

    assert strategies([]) == {"fsdp2", "deepspeed"}
    assert strategies(VERL_LORA) == {"fsdp2", "deepspeed"}  # both build adapters


def test_fsdp2_advice_adds_nodes_and_lowers_a_budget_above_the_width():
    short = ["data.max_response_length=4096", "reward_model.overlong_buffer.len=1024"]
    fp32 = [f"{MIXED}=fp32"]
    base = _fsdp2(typed(load_config(CONFIGS / "dapo_qwen2.5_32b.yaml", DS + short + fp32)), nnodes=1)
    gpu = parse_bytes("80GiB")
    plan = make_plan(base, gpu_mem=gpu)
    assert plan.gpu is not None and [r.role for r in plan.failures()] == [plan.gpu.role]
    knobs = advise(base, plan.gpu.role, gpu_mem=gpu, host_mem=None)
    (knob,) = knobs  # no single change fits: one combined, trimmed change
    changes = dict(item.split("=") for item in knob.split())
    assert int(changes["trainer.nnodes"]) > 1
    assert int(changes["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]) >= 2048 + 4096  # not below T
    assert not make_plan(apply_overrides(base, knob.split()), gpu_mem=gpu).failures()
    for key in changes:  # trimmed: without any one of its parts it does not fit
        rest = [item for item in knob.split() if not item.startswith(key + "=")]
        assert make_plan(apply_overrides(base, rest), gpu_mem=gpu).failures(), key


ZERO1 = [
    "actor_rollout_ref.actor.deepspeed.zero_stage=1",
    "actor_rollout_ref.actor.deepspeed.offload_param=false",
]


SCENARIOS = {
    # name: (overrides on the 32B config, GPU memory, the failing check)
    "zero1, no offload, no checkpointing": (
        SMALL
        + ZERO1
        + [
            "actor_rollout_ref.actor.deepspeed.offload_optimizer=false",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        ],
        "32GiB",
        "actor",
    ),
    "token budget above the width": (
        SMALL
        + ZERO1
        + [
            "data.max_response_length=8192",
            "reward_model.overlong_buffer.len=1024",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=81920",
        ],
        "24GiB",
        "actor",
    ),
    "float32 reference, two rows per forward": (
        [
            *SMALL,
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=45056",
        ],
        "30GiB",
        "ref",
    ),
    "vLLM without room for one sequence": (
        [*SMALL, "actor_rollout_ref.rollout.gpu_memory_utilization=0.05"],
        "32GiB",
        "rollout",
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_advice_applied_through_the_loader_makes_the_plan_fit(name):
    overrides, gpu, failing = SCENARIOS[name]
    cfg = typed(load_config(CONFIGS / BIG_32B[0], overrides))
    plan = make_plan(cfg, gpu_mem=parse_bytes(gpu))
    assert [r.role for r in plan.failures()] == [failing]
    knobs = advise(cfg, failing, gpu_mem=parse_bytes(gpu), host_mem=None)
    assert knobs, name
    for knob in knobs:
        fixed = make_plan(
            typed(load_config(CONFIGS / BIG_32B[0], overrides + knob.split())), gpu_mem=parse_bytes(gpu)
        )
        assert not fixed.failures(), (name, knob)


def test_a_token_budget_at_the_width_is_not_advised_with_packing():
    # Packed and budget = T: a row longer than the budget goes alone, so lowering the budget changes nothing.
    overrides = SMALL + ZERO1
    cfg = typed(load_config(CONFIGS / BIG_32B[0], overrides))
    gpu = parse_bytes("16GiB")
    assert [r.role for r in make_plan(cfg, gpu_mem=gpu).failures()] == ["actor"]
    knobs = advise(cfg, "actor", gpu_mem=gpu, host_mem=None)
    assert not any("ppo_max_token_len_per_gpu" in k for k in knobs)
    lowered = typed(
        load_config(
            CONFIGS / BIG_32B[0], [*overrides, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"]
        )
    )
    assert make_plan(lowered, gpu_mem=gpu).roles[0].total == make_plan(cfg, gpu_mem=gpu).roles[0].total
    # Above the width it does lower the plan, and the advice names the largest value that fits.
    _, gpu_text, _ = SCENARIOS["token budget above the width"]
    knobs = advise(
        typed(load_config(CONFIGS / BIG_32B[0], SCENARIOS["token budget above the width"][0])),
        "actor",
        gpu_mem=parse_bytes(gpu_text),
        host_mem=None,
    )
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10240" in knobs


def test_plan_names_the_role_and_the_change_when_it_does_not_fit(capsys):
    overrides, gpu, _ = SCENARIOS["zero1, no offload, no checkpointing"]
    args = ["--config", str(CONFIGS / BIG_32B[0]), "--gpu-mem", gpu, *overrides]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert "actor needs" in err and "enable_gradient_checkpointing=true" in err
    # `dapo train` runs the plan first and refuses before any data, model or Prefect work.
    assert main(["train", *args]) == 2
    assert "refusing to start a run that cannot fit" in capsys.readouterr().err
