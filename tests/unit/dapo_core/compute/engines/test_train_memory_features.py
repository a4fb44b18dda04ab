"""Memory features: gradient checkpointing, token-budget micro-batches, packed (padding-free) forwards.

Each feature must leave the numbers alone: the same gradients with and without checkpointing, the same loss
and gradients whatever the micro-batch split (the normalisation trap: a per-micro-batch token mean would
differ), and the same log-probs / entropy from a packed forward as from the padded one.
"""

from __future__ import annotations

import dataclasses
import random

import pyarrow as pa
import pytest
import torch

from dapo_core.algo.losses import PolicyLossParams, actor_objective
from dapo_core.compute.engines.ppo import minibatch_update, ppo_update
from dapo_core.compute.engines.train import _checkpointing, make_train_engine
from dapo_core.compute.microbatch import pack_rows, row_token_costs, token_budget_split
from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.workers.actor import ActorWorker
from dapo_core.config.schema import ActorConfig
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

TINY = tiny_model_cfg(hidden_size=32, intermediate_size=64, max_position_embeddings=128)
OPTIM = {"lr": 1e-2, "weight_decay": 0.1}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TINY, seed=3)


def ragged_batch(n=8, prompt_len=6, resp_len=10, seed=0):
    """Left-padded prompts and right-padded responses of very different lengths (a long-tailed mix)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (n, prompt_len + resp_len), generator=g)
    mask = torch.ones_like(ids)
    for i in range(n):
        mask[i, : i % 4] = 0  # left padding of the prompt (at least 3 prompt tokens stay)
        mask[i, prompt_len + 1 + (7 * i) % resp_len :] = 0  # response of 1..resp_len tokens
    ids = ids.masked_fill(mask == 0, 0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": mask[:, prompt_len:].double(),
        "advantages": torch.randn(n, resp_len, generator=g, dtype=torch.float64),
        "old_log_probs": -4.6 + 0.1 * torch.randn(n, resp_len, generator=g, dtype=torch.float64),
    }


def loss_fn_for(mode):
    def loss_fn(log_probs, entropy, micro, info):
        return actor_objective(
            micro["old_log_probs"],
            log_probs,
            micro["advantages"],
            micro["response_mask"],
            params=PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0),
            loss_agg_mode=mode,
            entropy=entropy,
            entropy_coeff=0.01,
            global_batch_info=info,
        )

    return loss_fn


def engine(tiny_dir, **kw):
    return make_train_engine(
        "torch", tiny_dir, OPTIM, total_steps=4, grad_clip=1.0, dtype=torch.float64, seed=0, **kw
    )


def grads_of_one_minibatch(
    eng, batch, mode, *, micro_batch_size=None, token_budget=None, packed=False, local_norm=False
):
    """Loss and gradients of one mini-batch through the production loop (`minibatch_update`)."""
    eng.train()
    resp_len = batch["response_mask"].shape[1]
    loss_fn = loss_fn_for(mode)
    captured = {}

    def micro_loss(micro, info):
        if local_norm:  # the trap: normalise each micro-batch by itself
            info = {"dp_size": 1}
        lp, ent = eng.forward(
            micro["input_ids"],
            micro["attention_mask"],
            micro["position_ids"],
            resp_len,
            calculate_entropy=True,
            remove_padding=packed,
        )
        return loss_fn(lp, ent, micro, info)

    def optimizer_step():
        captured.update({k: p.grad.detach().clone() for k, p in eng.model.named_parameters()})
        eng.model.zero_grad(set_to_none=True)
        return {}

    n = batch["input_ids"].shape[0]
    metrics = minibatch_update(
        batch,
        micro_loss=micro_loss,
        backward=eng.backward,
        optimizer_step=optimizer_step,
        device="cpu",
        mini_batch_size=n,
        micro_batch_size=micro_batch_size or n,
        sum_keys=("actor/pg_loss",),
        token_budget=token_budget,
        row_tokens=row_token_costs(batch["attention_mask"], packed) if token_budget else None,
    )
    return metrics["actor/pg_loss"], captured


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ------------------------------------------------------------------------------------------ the split
def test_token_budget_split_respects_budget_and_keeps_every_row_once():
    rng = random.Random(0)
    for trial in range(200):
        budget = rng.randint(1, 64)
        costs = [rng.randint(0, 80) for _ in range(rng.randint(0, 40))]
        groups = token_budget_split(costs, budget)
        flat = sorted(i for g in groups for i in g)
        assert flat == list(range(len(costs))), trial
        for g in groups:
            assert g == sorted(g)
            load = sum(costs[i] for i in g)
            assert load <= budget or (len(g) == 1 and costs[g[0]] > budget), (trial, g, load, budget)
    assert token_budget_split([5, 30, 5, 5], 10) == [[1], [0, 2], [3]]
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        token_budget_split([1, 2], 0)


def test_row_costs_are_valid_tokens_when_packed_and_the_padded_width_otherwise():
    b = ragged_batch()
    assert torch.equal(row_token_costs(b["attention_mask"], True), b["attention_mask"].sum(1))
    assert row_token_costs(b["attention_mask"], False).tolist() == [16] * 8


def test_pack_rows_needs_a_prompt_token_before_the_response():
    ids = torch.tensor([[0, 0, 5, 6], [0, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    with pytest.raises(ValueError, match="row 0 has a response token without a valid token"):
        pack_rows(ids, mask, 2)
    packed = pack_rows(ids[1:], mask[1:], 2)
    assert packed.input_ids.tolist() == [[4, 5, 6]] and packed.position_ids.tolist() == [[0, 1, 2]]
    assert packed.label_index.tolist() == [1, 2] and packed.logit_index.tolist() == [0, 1]


# ------------------------------------------------------------------------------------- checkpointing
def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir):
    batch = ragged_batch()
    plain = engine(tiny_dir)
    ckpt = engine(tiny_dir, gradient_checkpointing=True)
    assert _checkpointing(ckpt.model) and not _checkpointing(plain.model)
    loss_a, g_a = grads_of_one_minibatch(plain, batch, "token-mean", micro_batch_size=3)
    loss_b, g_b = grads_of_one_minibatch(ckpt, batch, "token-mean", micro_batch_size=3)
    assert loss_a == pytest.approx(loss_b, abs=1e-12)
    assert max_diff(g_a, g_b) < 1e-12
    assert max(float(g.abs().max()) for g in g_a.values()) > 1e-6  # the gradients are not trivially zero


def test_gradient_checkpointing_on_deepspeed(tiny_dir):
    pytest.importorskip("deepspeed")
    batch = {k: v.float() if v.is_floating_point() else v for k, v in ragged_batch().items()}
    results = []
    for on in (False, True):
        eng = make_train_engine(
            "deepspeed",
            tiny_dir,
            OPTIM,
            total_steps=4,
            grad_clip=1.0,
            seed=0,
            deepspeed_cfg={"zero_stage": 1},
            gradient_checkpointing=on,
        )
        assert _checkpointing(eng.model) == on
        ppo_update(eng, batch, loss_fn=loss_fn_for("token-mean"), mini_batch_size=8, micro_batch_size=4)
        results.append({k: v.detach().clone() for k, v in eng.state_dict_for_sync().items()})
        eng.close()
    assert max_diff(results[0], results[1]) < 1e-6


# ------------------------------------------------------------------------------- token-budget splits
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_budget_micro_batches_give_the_same_loss_and_gradients(tiny_dir, mode):
    batch = ragged_batch()
    eng = engine(tiny_dir)
    loss_whole, g_whole = grads_of_one_minibatch(eng, batch, mode)
    for budget in (16, 20, 48):  # padded cost 16 per row: 1, 1 and 3 rows per micro-batch
        loss_b, g_b = grads_of_one_minibatch(eng, batch, mode, token_budget=budget)
        assert loss_b == pytest.approx(loss_whole, abs=1e-12), budget
        assert max_diff(g_whole, g_b) < 1e-12, budget
    for budget in (14, 25):  # packed costs (valid tokens, 5..16 per row)
        loss_p, g_p = grads_of_one_minibatch(eng, batch, mode, token_budget=budget, packed=True)
        assert loss_p == pytest.approx(loss_whole, abs=1e-10), budget
        assert max_diff(g_whole, g_p) < 1e-10, budget
    # The trap this guards against: normalising each micro-batch by its own tokens/rows changes the update.
    _, g_trap = grads_of_one_minibatch(eng, batch, mode, token_budget=20, local_norm=True)
    assert max_diff(g_whole, g_trap) > 1e-6


# ---------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.float64, 1e-10)])
def test_packed_log_probs_and_entropy_equal_the_padded_ones(tiny_dir, dtype, tol):
    batch = ragged_batch(n=6, seed=1)
    eng = make_train_engine("torch", tiny_dir, OPTIM, total_steps=1, grad_clip=1.0, dtype=dtype)
    eng.eval()
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], 10)
    lp, ent = eng.forward(*args, temperature=0.7, calculate_entropy=True)
    lp_p, ent_p = eng.forward(*args, temperature=0.7, calculate_entropy=True, remove_padding=True)
    m = batch["response_mask"].bool()
    assert float((lp - lp_p)[m].abs().max()) < tol
    assert float((ent - ent_p)[m].abs().max()) < tol
    assert float(lp_p[~m].abs().max()) == 0.0  # padded response positions are zero in the packed output


def test_actor_log_probs_with_token_budget_and_packing_keep_row_order(tiny_dir):
    g = torch.Generator().manual_seed(5)
    plens = [3, 7, 2, 5, 4, 6, 3, 8]
    rlens = [9, 1, 12, 4, 2, 7, 11, 3]
    table = pa.table(
        {
            "prompt_ids": [torch.randint(4, 99, (p,), generator=g).tolist() for p in plens],
            "response_ids": [torch.randint(4, 99, (r,), generator=g).tolist() for r in rlens],
        }
    )
    actor_cfg = dataclasses.asdict(ActorConfig(optim=dataclasses.replace(ActorConfig().optim, lr=0.0)))

    def worker(**kw):
        return ActorWorker(
            str(tiny_dir), actor_cfg, pad_token_id=0, temperature=1.0, rollout_n=1, total_steps=1, **kw
        )

    base = worker(log_prob_micro_batch_size=3).compute_log_prob(table)
    fast = worker(log_prob_max_token_len=14, use_remove_padding=True).compute_log_prob(table)
    for col in ("old_log_probs", "entropy"):
        a, b = base.column(col).to_pylist(), fast.column(col).to_pylist()
        assert [len(x) for x in b] == rlens
        assert (
            max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)) < 2e-5
        )


def test_chunked_packed_log_probs_give_the_same_gradients(tiny_dir, monkeypatch):
    """The packed path's float32 log-softmax runs in checkpointed chunks; small chunks change nothing."""
    import dapo_core.compute.engines.train as train_mod

    batch = ragged_batch()
    eng = engine(tiny_dir)
    loss_whole, g_whole = grads_of_one_minibatch(eng, batch, "token-mean")
    monkeypatch.setattr(train_mod, "LOGIT_CHUNK_TOKENS", 5)
    loss_c, g_c = grads_of_one_minibatch(eng, batch, "token-mean", token_budget=30, packed=True)
    assert loss_c == pytest.approx(loss_whole, abs=1e-10)
    assert max_diff(g_whole, g_c) < 1e-10
