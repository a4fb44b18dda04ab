"""Tests for the training engines (torch, DeepSpeed ZeRO 1/2/3), LR schedule and the PPO update loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dapo_core.algo.losses import PolicyLossParams, actor_objective
from dapo_core.compute.engines.ppo import ppo_update
from dapo_core.compute.engines.train import (
    OptimConfigError,
    entropy_from_logits,
    lr_lambda_for,
    make_train_engine,
    response_log_probs,
)
from dapo_core.compute.models import build_tiny_model, load_model, load_tokenizer
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

TINY = tiny_model_cfg(hidden_size=32, intermediate_size=64, max_position_embeddings=128)
OPTIM = {
    "lr": 1e-2,
    "betas": (0.9, 0.99),
    "weight_decay": 0.1,
    "lr_warmup_steps": 2,
    "warmup_style": "constant",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TINY, seed=1)


def make_batch(n=8, prompt_len=5, resp_len=6, seed=0):
    """Left-padded prompts, right-padded responses, random advantages and old log-probs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (n, prompt_len + resp_len), generator=g)
    mask = torch.ones_like(ids)
    for i in range(n):
        mask[i, : i % 3] = 0  # left padding
        mask[i, prompt_len + resp_len - (i % 4) :] = 0  # right padding (short responses)
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": pos,
        "response_mask": mask[:, prompt_len:].float(),
        "advantages": torch.randn(n, resp_len, generator=g),
        "old_log_probs": -4.6 + 0.1 * torch.randn(n, resp_len, generator=g),
    }


def token_mean_pg_loss(log_probs, entropy, micro, info):
    """The actor's loss (`actor_objective`, DAPO's vanilla loss, token-mean over the mini-batch)."""
    return actor_objective(
        micro["old_log_probs"],
        log_probs,
        micro["advantages"],
        micro["response_mask"],
        params=PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0),
        entropy=entropy,
        global_batch_info=info,
    )


def params_of(engine):
    return {k: v.detach().clone() for k, v in engine.state_dict_for_sync().items()}


def max_param_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# --------------------------------------------------------------------------- shared numerics
def test_response_log_probs_and_entropy_reference():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 5))
    lp, ent = response_log_probs(logits, ids, 3, temperature=0.5, calculate_entropy=True)
    z = logits[:, 1:4] / 0.5
    p = torch.softmax(z, -1)
    ref_lp = torch.log(p).gather(-1, ids[:, 2:, None]).squeeze(-1)
    ref_ent = -(p * torch.log(p)).sum(-1)
    assert lp.dtype == torch.float64
    assert torch.allclose(lp, ref_lp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    assert torch.allclose(entropy_from_logits(torch.zeros(1, 4)), torch.tensor([math.log(4)]))
    peaked = entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    assert peaked.item() == pytest.approx(0.0, abs=1e-30)  # no 0·log 0 NaN for a one-hot distribution
    with pytest.raises(ValueError, match="response_length"):
        response_log_probs(logits, ids, 5)


def test_lr_schedule_warmup_constant_and_cosine():
    const = lr_lambda_for({"lr_warmup_steps": 4, "warmup_style": "constant"}, total_steps=10)
    assert [const(s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    ratio = lr_lambda_for({"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.2}, total_steps=10)
    assert [ratio(s) for s in range(3)] == [0.0, 0.5, 1.0]
    assert lr_lambda_for({}, total_steps=10)(0) == 1.0  # no warmup
    cos = lr_lambda_for({"lr_warmup_steps": 2, "warmup_style": "cosine", "min_lr_ratio": 0.1}, total_steps=12)
    assert cos(1) == 0.5 and cos(2) == 1.0
    assert cos(7) == pytest.approx(0.55) and cos(12) == pytest.approx(0.1) and cos(20) == pytest.approx(0.1)
    with pytest.raises(OptimConfigError, match="warmup_style"):
        lr_lambda_for({"warmup_style": "linear"}, 10)


def test_engine_lr_follows_lr_step(tiny_dir):
    eng = make_train_engine("torch", tiny_dir, OPTIM, total_steps=10, grad_clip=1.0)
    lrs = [eng.lr]
    for _ in range(3):
        eng.lr_step()
        lrs.append(eng.lr)
    assert lrs == pytest.approx([0.0, 5e-3, 1e-2, 1e-2])


# --------------------------------------------------------------------------- torch engine
def test_forward_grad_modes_and_float64(tiny_dir):
    batch = make_batch()
    eng = make_train_engine("torch", tiny_dir, OPTIM, total_steps=5, grad_clip=1.0, dtype=torch.float64)
    eng.eval()
    lp, ent = eng.forward(
        batch["input_ids"], batch["attention_mask"], batch["position_ids"], 6, calculate_entropy=True
    )
    assert lp.shape == ent.shape == (8, 6) and lp.dtype == torch.float64 and not lp.requires_grad
    eng.train()
    lp2, none = eng.forward(batch["input_ids"], batch["attention_mask"], batch["position_ids"], 6)
    assert lp2.requires_grad and none is None
    assert torch.equal(lp, lp2.detach())


def test_autocast_bf16_forward_within_tolerance_keeps_float32_state(tiny_dir):
    """`compute_dtype=bfloat16`: bf16 matmuls under autocast, float32 log-probs, weights, gradients and AdamW
    state; log-probs within bf16's error of float32's, and an update close to float32's."""
    batch = make_batch()
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], 6)
    fp32 = make_train_engine("torch", tiny_dir, OPTIM, total_steps=5, grad_clip=1.0)
    bf16 = make_train_engine(
        "torch", tiny_dir, OPTIM, total_steps=5, grad_clip=1.0, compute_dtype=torch.bfloat16
    )
    same = make_train_engine(
        "torch", tiny_dir, OPTIM, total_steps=5, grad_clip=1.0, compute_dtype=torch.float32
    )
    assert (fp32.autocast_dtype, bf16.autocast_dtype, same.autocast_dtype) == (None, torch.bfloat16, None)
    for eng in (fp32, bf16):
        eng.eval()
    want, got = fp32.forward(*args)[0], bf16.forward(*args)[0]
    valid = batch["response_mask"].bool()
    diff = (got - want).abs()[valid]
    assert got.dtype == torch.float32
    assert 0 < float(diff.max()) < 0.05, float(diff.max())  # bf16 rounding, nothing worse
    metrics = {}
    for name, eng in (("fp32", fp32), ("bf16", bf16)):
        eng.train()
        eng.lr_step()
        metrics[name] = ppo_update(
            eng, batch, loss_fn=token_mean_pg_loss, mini_batch_size=8, micro_batch_size=4
        )
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(t.dtype == torch.float32 for s in bf16.optimizer.state.values() for t in s.values() if t.dim())
    assert metrics["bf16"]["actor/grad_norm"] != metrics["fp32"]["actor/grad_norm"]
    assert metrics["bf16"]["actor/grad_norm"] == pytest.approx(metrics["fp32"]["actor/grad_norm"], rel=0.05)
    base = {k: v.float() for k, v in load_model(tiny_dir).state_dict().items()}
    step = {
        n: torch.cat([(p[k] - base[k]).flatten() for k in base])
        for n, p in (("fp32", params_of(fp32)), ("bf16", params_of(bf16)))
    }
    cosine = float(torch.nn.functional.cosine_similarity(step["fp32"], step["bf16"], dim=0))
    assert cosine > 0.9, cosine  # AdamW's first step is about lr·sign(grad): tiny gradients may flip sign


@pytest.mark.parametrize(
    ("dtype", "lr", "epochs", "tol"), [(torch.float64, 1e-2, 2, 1e-10), (torch.float32, 1e-3, 1, 1e-6)]
)
def test_micro_batch_split_gives_same_update(tiny_dir, dtype, lr, epochs, tol):
    batch = make_batch()
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    results = []
    for micro in (4, 1, 3):
        eng = make_train_engine(
            "torch", tiny_dir, {**OPTIM, "lr": lr}, total_steps=5, grad_clip=1.0, dtype=dtype
        )
        eng.lr_step()
        metrics = ppo_update(
            eng,
            batch,
            loss_fn=token_mean_pg_loss,
            mini_batch_size=4,
            micro_batch_size=micro,
            epochs=epochs,
            shuffle=True,
        )
        results.append((params_of(eng), metrics))
    (p0, m0), *rest = results
    moved = max_param_diff(
        p0, {k: v.to(dtype) for k, v in load_model(tiny_dir, dtype=dtype).state_dict().items()}
    )
    assert moved > 100 * tol  # the update did something
    for p, m in rest:
        assert max_param_diff(p0, p) <= tol
        assert m["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], abs=1e-6)  # summed over micro-batches
        assert m["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=1e-5)
    assert m0["actor/lr"] == pytest.approx(lr / 2)
    assert set(m0) == {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/grad_norm",
        "actor/lr",
    }


def test_ppo_update_global_batch_info_and_shuffle_seed(tiny_dir):
    batch = make_batch(n=6)
    seen = []

    def spy(log_probs, entropy, micro, info):
        seen.append((dict(info), micro["input_ids"][:, 0].tolist(), entropy is not None))
        return token_mean_pg_loss(log_probs, entropy, micro, info)

    eng = make_train_engine("torch", tiny_dir, OPTIM, total_steps=5, grad_clip=1.0)
    ppo_update(eng, batch, loss_fn=spy, mini_batch_size=3, micro_batch_size=2, calculate_entropy=True)
    assert [s[0]["global_batch_size"] for s in seen] == [3, 3, 3, 3]
    assert seen[0][0]["batch_num_tokens"] == int(batch["response_mask"][:3].sum())
    assert seen[2][0]["batch_num_tokens"] == int(batch["response_mask"][3:].sum())
    assert seen[0][1] + seen[1][1] == batch["input_ids"][:3, 0].tolist() and all(s[2] for s in seen)
    orders = []
    for seed in (0, 0, 1):
        seen.clear()
        ppo_update(eng, batch, loss_fn=spy, mini_batch_size=6, micro_batch_size=6, shuffle=True, seed=seed)
        orders.append(seen[0][1])
    assert orders[0] == orders[1] != orders[2]
    with pytest.raises(ValueError, match="mini_batch_size"):
        ppo_update(eng, batch, loss_fn=spy, mini_batch_size=4, micro_batch_size=2)
    with pytest.raises(KeyError, match="response_mask"):
        ppo_update(
            eng,
            {k: v for k, v in batch.items() if k != "response_mask"},
            loss_fn=spy,
            mini_batch_size=6,
            micro_batch_size=2,
        )


def test_grad_clip_and_nonfinite_step_is_skipped(tiny_dir):
    batch = make_batch()
    eng = make_train_engine("torch", tiny_dir, {"lr": 1e-2}, total_steps=5, grad_clip=1e-3)
    before = params_of(eng)
    lp, _ = eng.forward(batch["input_ids"], batch["attention_mask"], batch["position_ids"], 6)
    eng.backward(lp.sum() * float("nan"))
    assert math.isnan(eng.step())
    assert eng.skipped_steps == 1 and max_param_diff(before, params_of(eng)) == 0.0
    lp, _ = eng.forward(batch["input_ids"], batch["attention_mask"], batch["position_ids"], 6)
    eng.backward(-lp.mean())
    params = list(eng.model.parameters())
    norm = eng.step()
    assert math.isfinite(norm) and norm > 1e-3 and eng.skipped_steps == 1 and eng.optimizer_steps == 1
    assert all(p.grad is None for p in params)


def _train(eng, batch, steps):
    losses = []
    for _ in range(steps):
        m = ppo_update(
            eng, batch, loss_fn=token_mean_pg_loss, mini_batch_size=4, micro_batch_size=2, shuffle=True
        )
        eng.lr_step()
        losses.append(m["actor/pg_loss"])
    return losses


def test_save_load_is_bitwise(tiny_dir, tmp_path):
    batch = make_batch()
    a = make_train_engine("torch", tiny_dir, OPTIM, total_steps=6, grad_clip=1.0)
    _train(a, batch, 2)
    a.save(tmp_path / "ckpt")
    rand_after_save = torch.rand(4)
    np_after_save = np.random.rand(2)
    cont_a = _train(a, batch, 2)
    b = make_train_engine("torch", tiny_dir, OPTIM, total_steps=6, grad_clip=1.0, seed=99)
    b.load(tmp_path / "ckpt")
    assert torch.equal(torch.rand(4), rand_after_save) and np.array_equal(np.random.rand(2), np_after_save)
    cont_b = _train(b, batch, 2)
    assert cont_a == cont_b and b.lr == a.lr and b.optimizer_steps == a.optimizer_steps
    assert max_param_diff(params_of(a), params_of(b)) == 0.0
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)
    # The checkpoint folder is also a loadable HF model with the char tokenizer.
    model = load_model(tmp_path / "ckpt")
    assert (
        load_tokenizer(tmp_path / "ckpt").decode(load_tokenizer(tmp_path / "ckpt").encode("a b\n")) == "a b\n"
    )
    assert model.config.vocab_size == a.model.config.vocab_size
    with pytest.raises(FileNotFoundError):
        b.load(tmp_path)


def test_export_hf_matches_weights(tiny_dir, tmp_path):
    eng = make_train_engine("torch", tiny_dir, OPTIM, total_steps=3, grad_clip=1.0)
    eng.lr_step()
    _train(eng, make_batch(), 1)
    out = eng.export_hf(tmp_path / "hf")
    reloaded = load_model(out)
    assert max_param_diff(params_of(eng), dict(reloaded.state_dict())) == 0.0
    assert (out / "tokenizer" / "tokenizer.json").is_file()


# --------------------------------------------------------------------------- DeepSpeed
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_deepspeed_matches_torch_and_round_trips(tiny_dir, tmp_path, zero_stage):
    pytest.importorskip("deepspeed")
    batch = make_batch()
    optim = {**OPTIM, "lr": 2e-3}
    ref = make_train_engine("torch", tiny_dir, optim, total_steps=6, grad_clip=0.5)
    ds = make_train_engine(
        "deepspeed", tiny_dir, optim, total_steps=6, grad_clip=0.5, deepspeed_cfg={"zero_stage": zero_stage}
    )
    try:
        for eng in (ref, ds):
            eng.lr_step()
        torch.manual_seed(5)
        ref_losses = _train(ref, batch, 3)
        torch.manual_seed(5)
        ds_losses = _train(ds, batch, 3)
        assert np.allclose(ref_losses, ds_losses, atol=1e-5, rtol=0)
        assert ds.lr == ref.lr
        assert max_param_diff(params_of(ref), params_of(ds)) <= 1e-5
        # A non-finite gradient skips the step.
        before = params_of(ds)
        lp, _ = ds.forward(batch["input_ids"], batch["attention_mask"], batch["position_ids"], 6)
        ds.backward(lp.sum() * float("inf"))
        assert not math.isfinite(ds.step())
        assert ds.skipped_steps == 1 and max_param_diff(before, params_of(ds)) == 0.0
        ds.save(tmp_path / "ckpt")
        cont = _train(ds, batch, 1)
        after = params_of(ds)
        ds.load(tmp_path / "ckpt")
        assert _train(ds, batch, 1) == cont
        assert max_param_diff(after, params_of(ds)) == 0.0
        assert max_param_diff(after, dict(load_model(ds.export_hf(tmp_path / "hf")).state_dict())) == 0.0
    finally:
        ds.close()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_deepspeed_lora_matches_torch_lora_and_round_trips(tiny_dir, tmp_path, zero_stage):
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from dapo_core.compute.lora import ADAPTER_SUBDIR, ADAPTER_WEIGHTS, LoraSpec

    spec, batch, optim = LoraSpec(rank=4, alpha=8), make_batch(), {**OPTIM, "lr": 2e-2}
    ref = make_train_engine("torch", tiny_dir, optim, total_steps=6, grad_clip=0.5, lora=spec)
    ds = make_train_engine(
        "deepspeed",
        tiny_dir,
        optim,
        total_steps=6,
        grad_clip=0.5,
        deepspeed_cfg={"zero_stage": zero_stage},
        lora=spec,
    )
    try:
        trainable = [p for p in ds.model.parameters() if p.requires_grad]
        assert trainable and all(
            ".lora_A." in n or ".lora_B." in n for n, p in ds.model.named_parameters() if p.requires_grad
        )
        base = params_of(ds)
        for eng in (ref, ds):
            eng.lr_step()
        torch.manual_seed(5)
        ref_losses = _train(ref, batch, 3)
        torch.manual_seed(5)
        ds_losses = _train(ds, batch, 3)
        assert np.allclose(ref_losses, ds_losses, atol=1e-5, rtol=0)
        moments = [
            t for st in ds.base_optimizer.state.values() for k, t in st.items() if k.startswith("exp_")
        ]
        n_adapter = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)
        assert sum(t.numel() for t in moments) == 2 * n_adapter  # ZeRO's AdamW state: the adapters only
        merged = params_of(ds)  # the merged weights W + B·A·alpha/r under the base names
        assert set(merged) == set(base) and max_param_diff(params_of(ref), merged) <= 1e-5
        assert max_param_diff(base, merged) > 1e-4  # the adapters trained
        ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        with ds.ref_mode(), ref.ref_mode(), torch.no_grad():  # the reference: adapters off, the base model
            assert torch.allclose(
                ds.forward(ids, mask, pos, 6)[0], ref.forward(ids, mask, pos, 6)[0], atol=1e-6
            )
        ds.save(tmp_path / "ckpt")
        module_states = next((tmp_path / "ckpt" / "deepspeed").rglob("*model_states.pt"))
        saved = torch.load(module_states, map_location="cpu", weights_only=False)["module"]
        assert saved and all(".lora_" in k for k in saved)  # the checkpoint holds no frozen base weight
        adapter = load_file(str(tmp_path / "ckpt" / ADAPTER_SUBDIR / ADAPTER_WEIGHTS))
        assert len(adapter) == len(trainable)
        from dapo_core.compute.lora_checkpoint import merge_into

        assert not (tmp_path / "ckpt" / "model.safetensors").exists()  # the adapter stands for the model
        exported = load_file(str(merge_into(tmp_path / "ckpt", tmp_path / "merged") / "model.safetensors"))
        assert max_param_diff(exported, merged) == 0.0
        cont = _train(ds, batch, 1)
        after = params_of(ds)
        ds.load(tmp_path / "ckpt")
        assert _train(ds, batch, 1) == cont and max_param_diff(after, params_of(ds)) == 0.0
        if zero_stage == 1:
            full = make_train_engine("deepspeed", tiny_dir, optim, total_steps=6, grad_clip=0.5)
            try:
                with pytest.raises(ValueError, match="lora_rank=4 and this run has lora_rank=0"):
                    full.load(tmp_path / "ckpt")
            finally:
                full.close()
    finally:
        ds.close()
