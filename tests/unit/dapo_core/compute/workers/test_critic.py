"""The critic's memory features and lr schedule (verl's `critic.*` keys), on a tiny value model.

Like the actor's (tests/unit/dapo_core/compute/engines/test_train_memory_features.py), each feature must
leave the numbers alone: the same value loss and gradients with fixed or token-budget micro-batches (the
normalisation trap: a per-micro-batch token mean would differ), the same values from a packed forward as from
the padded one, the same gradients with and without checkpointing; and the critic's schedule is the actor's
for the same settings.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from dapo_core.algo.losses import compute_value_loss
from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.microbatch import token_budget_split
from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.workers.critic import CriticWorker
from dapo_core.data import batch as B
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

TINY = tiny_model_cfg(hidden_size=32, intermediate_size=64, max_position_embeddings=128)
BASE = {"optim": {"lr": 1e-3}, "ppo_mini_batch_size": 2, "ppo_epochs": 1, "cliprange_value": 0.2}
N = 4  # rollout.n: one mini-batch of 2 prompts = 8 rows


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TINY, seed=3))


def ragged_table(rows: int = 8, seed: int = 0) -> pa.Table:
    """Prompts of 3-6 tokens and responses of 1-14 tokens (a long-tailed mix; at most 8 rows), with old
    values and returns."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = [3, 5, 4, 6, 3, 4, 6, 5][:rows]
    resp_lens = [1, 13, 3, 9, 2, 14, 5, 7][:rows]
    col = {
        "uid": [f"u{i // N}" for i in range(rows)],
        "sample_idx": pa.array([i % N for i in range(rows)], pa.int32()),
        "prompt_ids": pa.array(
            [torch.randint(4, 99, (p,), generator=g).tolist() for p in prompt_lens], pa.list_(pa.int32())
        ),
        "response_ids": pa.array(
            [torch.randint(4, 99, (r,), generator=g).tolist() for r in resp_lens], pa.list_(pa.int32())
        ),
        "values": pa.array(
            [(0.1 * torch.randn(r, generator=g)).tolist() for r in resp_lens], pa.list_(pa.float32())
        ),
        "returns": pa.array(
            [torch.randn(r, generator=g).tolist() for r in resp_lens], pa.list_(pa.float32())
        ),
    }
    return pa.table(col)


def critic(tiny_dir: str, **cfg) -> CriticWorker:
    """A critic whose value head is random (seeded, the same for every call), so the backbone gets gradients
    (the production head starts at zero)."""
    model_cfg = cfg.pop("model", {})
    optim = cfg.pop("optim", BASE["optim"])
    total_steps = cfg.pop("total_steps", 1)
    w = CriticWorker(
        tiny_dir,
        {**BASE, **cfg, "optim": optim, "model": model_cfg},
        pad_token_id=0,
        rollout_n=N,
        seed=1,
        total_steps=total_steps,
    )
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        w.model.v_head.weight.copy_(torch.randn(w.model.v_head.weight.shape, generator=g))
    return w


def update_grads(w: CriticWorker, table: pa.Table) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """`update_critic`'s metrics and the gradient each parameter had at the optimizer step (summed over the
    micro-batches: the last accumulation hook of a parameter sees the full sum)."""
    grads: dict[str, torch.Tensor] = {}
    hooks = [
        p.register_post_accumulate_grad_hook(lambda q, name=name: grads.__setitem__(name, q.grad.clone()))
        for name, p in w.model.named_parameters()
    ]
    try:
        metrics = w.update_critic(table, global_steps=1)
    finally:
        for h in hooks:
            h.remove()
    return metrics, grads


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def test_token_budget_micro_batches_give_the_loss_and_gradients_of_fixed_ones(tiny_dir):
    table = ragged_table()
    whole_m, whole_g = update_grads(critic(tiny_dir), table)
    fixed_m, fixed_g = update_grads(critic(tiny_dir, ppo_micro_batch_size_per_gpu=2), table)
    budget = 24
    t = B.to_padded(table, 0)
    costs = t["attention_mask"].sum(1)
    assert len(token_budget_split(costs, budget)) >= 3  # a real, uneven split
    dyn_m, dyn_g = update_grads(
        critic(
            tiny_dir,
            use_dynamic_bsz=True,
            ppo_max_token_len_per_gpu=budget,
            model={"use_remove_padding": True},
        ),
        table,
    )
    for m in (fixed_m, dyn_m):
        assert m["critic/vf_loss"] == pytest.approx(whole_m["critic/vf_loss"], rel=1e-5)
    assert_grads_close(fixed_g, whole_g)
    assert_grads_close(dyn_g, whole_g)

    # the trap the global normalisation avoids: token means per micro-batch, averaged, are another loss
    w = critic(tiny_dir)
    t = B.to_padded(table, 0, columns=["values", "returns"])
    with torch.no_grad():
        v = w._forward(t)
    per_micro = [
        compute_value_loss(v[g], t["returns"][g], t["values"][g], t["response_mask"][g], 0.2)[0]
        for g in (torch.tensor(x) for x in token_budget_split(costs, budget))
    ]
    assert float(torch.stack(per_micro).mean()) != pytest.approx(whole_m["critic/vf_loss"], rel=1e-3)


def test_padded_token_budget_update_equals_the_whole_batch(tiny_dir):
    table = ragged_table(seed=1)
    whole_m, whole_g = update_grads(critic(tiny_dir), table)
    width = int(B.prompt_lengths(table).max()) + int(B.response_lengths(table).max())
    dyn_m, dyn_g = update_grads(
        critic(tiny_dir, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=3 * width), table
    )
    assert dyn_m["critic/vf_loss"] == pytest.approx(whole_m["critic/vf_loss"], rel=1e-5)
    assert_grads_close(dyn_g, whole_g)


def test_packed_values_equal_padded_values(tiny_dir):
    table = ragged_table(seed=2).drop_columns(["values"])
    padded = critic(tiny_dir).compute_values(table).column("values").to_pylist()
    for cfg in (
        {"model": {"use_remove_padding": True}},
        {"model": {"use_remove_padding": True}, "use_dynamic_bsz": True, "forward_max_token_len_per_gpu": 30},
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 40},  # padded micro-batches of their own width
    ):
        got = critic(tiny_dir, **cfg).compute_values(table).column("values").to_pylist()
        assert [len(r) for r in got] == [len(r) for r in padded]
        for a, b in zip(got, padded, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5, msg=str(cfg))
    packed_m, packed_g = update_grads(
        critic(tiny_dir, model={"use_remove_padding": True}), ragged_table(seed=2)
    )
    padded_m, padded_g = update_grads(critic(tiny_dir), ragged_table(seed=2))
    assert packed_m["critic/vf_loss"] == pytest.approx(padded_m["critic/vf_loss"], rel=1e-5)
    assert_grads_close(packed_g, padded_g)


def test_gradient_checkpointing_leaves_the_gradients_alone(tiny_dir):
    table = ragged_table(seed=3)
    plain = critic(tiny_dir, model={"enable_gradient_checkpointing": False})
    ckpt = critic(tiny_dir, model={"enable_gradient_checkpointing": True})
    assert ckpt.model.backbone.gradient_checkpointing and not plain.model.backbone.gradient_checkpointing
    # null follows the policy model's switch (the flow passes actor_rollout_ref.model's)
    follows = CriticWorker(tiny_dir, BASE, pad_token_id=0, rollout_n=N, gradient_checkpointing=True)
    assert follows.model.backbone.gradient_checkpointing
    overrides = CriticWorker(
        tiny_dir,
        {**BASE, "model": {"enable_gradient_checkpointing": False}},
        pad_token_id=0,
        rollout_n=N,
        gradient_checkpointing=True,
    )
    assert not overrides.model.backbone.gradient_checkpointing
    plain_m, plain_g = update_grads(plain, table)
    ckpt_m, ckpt_g = update_grads(ckpt, table)
    assert ckpt_m["critic/vf_loss"] == pytest.approx(plain_m["critic/vf_loss"], rel=1e-6)
    assert_grads_close(ckpt_g, plain_g)


@pytest.mark.parametrize(
    "optim",
    [
        {
            "lr": 1e-3,
            "lr_warmup_steps": 2,
            "warmup_style": "cosine",
            "min_lr_ratio": 0.1,
            "betas": [0.8, 0.95],
        },
        {"lr": 2e-3, "lr_warmup_steps_ratio": 0.5, "warmup_style": "constant", "betas": [0.9, 0.999]},
    ],
)
def test_the_critic_schedule_is_the_actors(tiny_dir, tmp_path, optim):
    steps = 6
    engine = make_train_engine("torch", tiny_dir, optim, total_steps=steps, grad_clip=1.0)
    actor_lrs = []
    for _ in range(steps):
        actor_lrs.append(engine.lr)
        engine.lr_step()
    w = critic(tiny_dir, optim=optim, total_steps=steps)
    assert w.optimizer.param_groups[0]["betas"] == tuple(optim["betas"])
    table = ragged_table(seed=4)
    critic_lrs = [w.update_critic(table, global_steps=i)["critic/lr"] for i in range(3)]
    # a resumed critic continues the schedule where the checkpoint left it
    w.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = critic(tiny_dir, optim=optim, total_steps=steps)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    critic_lrs += [resumed.update_critic(table, global_steps=i)["critic/lr"] for i in range(3, steps)]
    assert critic_lrs == actor_lrs
    assert len(set(critic_lrs)) > 2  # warm-up then a schedule, not a constant


def test_default_critic_lr_is_constant_with_torch_default_adamw(tiny_dir):
    w = CriticWorker(tiny_dir, {**BASE, "optim": {"lr": 3e-3}}, pad_token_id=0, rollout_n=N)
    group = w.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-3,
        (0.9, 0.999),
        1e-8,
        0.01,
    )
    table = ragged_table(seed=5)
    assert [w.update_critic(table, global_steps=i)["critic/lr"] for i in range(3)] == [3e-3] * 3


def test_plan_critic_row_follows_the_critics_keys():
    from dapo_core.compute.plan import advise, make_plan
    from dapo_core.config import load_config, typed

    shape = [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.model.tiny.hidden_size=256",
        "actor_rollout_ref.model.tiny.intermediate_size=1024",
        "actor_rollout_ref.model.tiny.num_hidden_layers=4",
        "actor_rollout_ref.model.tiny.max_position_embeddings=512",
        "data.max_response_length=192",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    ]
    on = [
        "critic.model.enable_gradient_checkpointing=true",
        "critic.model.use_remove_padding=true",
        "critic.use_dynamic_bsz=true",
        "critic.ppo_max_token_len_per_gpu=1024",
        "critic.forward_max_token_len_per_gpu=2048",
    ]

    def role(overrides: list[str]):
        cfg = typed(load_config("configs/tiny_cpu.yaml", shape + overrides))
        return next(r for r in make_plan(cfg).roles if r.role == "critic")

    off, feat = role([]), role(on)

    def planned(r):  # what the keys change: every row but the process's fixed baseline
        return r.total - sum(x.bytes for x in r.rows if x.name == "process")

    assert planned(feat) < planned(off) / 2
    rows = {(r.phase, r.name): r for r in feat.rows}
    assert ("update", "activations (ckpt)") in rows
    assert not any(name == "packed mask" for _, name in rows)  # packed rows attend per row: no N×N mask
    assert "token budget 1024" in rows[("update", "activations (ckpt)")].formula
    assert "token budget 2048" in rows[("values", "activations (no grad)")].formula
    # a budget between the two: the advice for the plain critic names the critic's own switches
    budget = (off.total + feat.total) // 2
    cfg_off = typed(load_config("configs/tiny_cpu.yaml", shape))
    advice = " ".join(advise(cfg_off, "critic", gpu_mem=budget, host_mem=None))
    assert "critic." in advice and "actor_rollout_ref." not in advice, advice
    # null critic switches follow the policy's: actor checkpointing and token budgets reach the critic row
    follows = role(
        [
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
        ]
    )
    assert any(r.name == "activations (ckpt)" for r in follows.rows)
    update = next(r for r in follows.rows if r.phase == "update" and r.name.startswith("activations"))
    assert "within budget 32768" in update.formula
