"""Tests for LoRA on the torch training engine: the config keys and their refusals, only adapters training,
the reference through disabled adapters, the merged push / export and the adapter-only export (the FSDP2
engine's LoRA: engines/test_fsdp2_lora.py; the DeepSpeed engine's: engines/test_train.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.lora import ADAPTER_CONFIG, ADAPTER_SUBDIR, ADAPTER_WEIGHTS, LoraSpec
from dapo_core.compute.models import build_tiny_model, load_model
from dapo_core.config import ConfigError, ConfigWarning, load_config
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

TINY = tiny_model_cfg(hidden_size=32, intermediate_size=64, max_position_embeddings=128)
SPEC = LoraSpec(rank=4, alpha=8)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TINY, seed=1)


def _batch(n=4, prompt_len=5, resp_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (n, prompt_len + resp_len), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos, resp_len


def _engine(tiny_dir, spec=SPEC, lr=5e-2):
    return make_train_engine("torch", tiny_dir, {"lr": lr}, total_steps=4, grad_clip=1.0, seed=3, lora=spec)


def _train(engine, steps=2):
    ids, mask, pos, L = _batch()
    adv = torch.linspace(-1.0, 1.0, ids.shape[0])[:, None]
    engine.train()
    for _ in range(steps):
        lp, _ = engine.forward(ids, mask, pos, L)
        engine.backward(-(lp * adv * mask[:, -L:]).mean())
        engine.step()


def _log_probs(engine):
    engine.eval()
    ids, mask, pos, L = _batch(seed=1)
    return engine.forward(ids, mask, pos, L)[0]


# ---------------------------------------------------------------------------------------------- config keys
def _config(*overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(None, overrides)


def test_verl_lora_keys_load_and_default_off():
    c = _config()
    assert c.actor_rollout_ref.model.lora_rank == 0
    assert LoraSpec.from_model_config(c.actor_rollout_ref.model) is None
    c = _config(
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "actor_rollout_ref.model.exclude_modules=[k_proj]",
    )
    spec = LoraSpec.from_model_config(c.actor_rollout_ref.model)
    assert spec == LoraSpec(
        rank=8, alpha=32, target_modules=("q_proj", "v_proj"), exclude_modules=("k_proj",)
    )
    assert spec.scaling == 4.0


def test_negative_rank_is_one_paragraph_naming_the_key():
    with pytest.raises(ConfigError) as ei:
        _config("actor_rollout_ref.model.lora_rank=-4")
    msg = str(ei.value)
    assert "actor_rollout_ref.model.lora_rank" in msg and "-4" in msg and ">= 0" in msg


def test_lora_is_accepted_on_every_training_strategy():
    for strategy in ("torch", "fsdp2", "deepspeed"):
        c = _config("actor_rollout_ref.model.lora_rank=8", f"actor_rollout_ref.actor.strategy={strategy}")
        assert c.actor_rollout_ref.model.lora_rank == 8


def test_every_training_engine_builds_adapters_and_another_strategy_is_refused():
    from dapo_core.compute.engines.train import TRAIN_ENGINES
    from dapo_core.compute.lora import LORA_STRATEGIES, check_strategy

    assert set(TRAIN_ENGINES) <= set(LORA_STRATEGIES)  # the deepspeed engine: engines/test_train.py
    with pytest.raises(ConfigError) as ei:
        check_strategy("megatron", SPEC)
    msg = str(ei.value)
    assert "strategy='megatron'" in msg and "strategy=fsdp2" in msg and "strategy=deepspeed" in msg


def test_unknown_target_module_names_the_key_and_the_layers(tiny_dir):
    with pytest.raises(ConfigError) as ei:
        _engine(tiny_dir, LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "query_key_value")))
    msg = str(ei.value)
    assert "actor_rollout_ref.model.target_modules" in msg and "query_key_value" in msg
    assert "q_proj" in msg.split("Fix:")[1]  # the fix lists the model's own layer names


def test_an_adapter_on_a_tied_lm_head_is_refused_naming_the_key(tiny_dir):
    with pytest.raises(ConfigError) as ei:
        _engine(tiny_dir, LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "lm_head")))
    msg = str(ei.value)
    assert "actor_rollout_ref.model.target_modules" in msg and "tie_word_embeddings" in msg
    assert "leave lm_head out" in msg


# ---------------------------------------------------------------------------------------------- training
def test_only_adapters_train_and_base_weights_stay_bitwise(tiny_dir):
    engine = _engine(tiny_dir)
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in engine.model.named_parameters() if n in trainable}
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if n not in trainable}
    lora_b = {n: p.detach().clone() for n, p in engine.model.named_parameters() if ".lora_B." in n}
    assert all(not v.any() for v in lora_b.values())  # B starts at zero: the adapted model is the base
    _train(engine)
    for n, p in engine.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert any(p.any() for n, p in engine.model.named_parameters() if ".lora_B." in n)
    assert len(engine.optimizer.state) == len(trainable)  # optimizer state for the adapters only


def test_reference_via_disabled_adapters_equals_the_base_model(tiny_dir):
    engine = _engine(tiny_dir)
    _train(engine)
    base = make_train_engine("torch", tiny_dir, {"lr": 0.0}, total_steps=1, grad_clip=1.0)
    want = _log_probs(base)
    with engine.ref_mode():
        ref = _log_probs(engine)
    assert torch.equal(ref, want)
    assert not torch.allclose(_log_probs(engine), want, atol=1e-4)  # adapters back on: the trained policy
    with pytest.raises(RuntimeError, match="lora_rank"):
        base.ref_mode()


# ---------------------------------------------------------------------------------------------- push / export
def test_merged_weights_are_base_plus_scaled_ba_under_base_names(tiny_dir, tmp_path):
    engine = _engine(tiny_dir)
    _train(engine)
    base = load_file(str(tiny_dir / "model.safetensors"))
    params = dict(engine.model.named_parameters())
    pushed = dict(engine.iter_sync_tensors())
    assert set(pushed) == set(engine.state_dict_for_sync()) and not any("lora_" in n for n in pushed)
    assert all("base_layer" not in n and not n.startswith("base_model") for n in pushed)
    out = engine.export_hf(tmp_path / "hf")
    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(base)
    adapted = 0
    for name, w in base.items():
        prefix = name.removesuffix(".weight")
        a = params.get(f"{prefix}.lora_A.default.weight")
        if a is None:
            assert torch.equal(exported[name], w), name
            continue
        b = params[f"{prefix}.lora_B.default.weight"]
        want = w + (b.detach() @ a.detach()) * (SPEC.alpha / SPEC.rank)
        torch.testing.assert_close(exported[name], want, rtol=0, atol=1e-6)
        torch.testing.assert_close(pushed[name], want, rtol=0, atol=1e-6)
        assert not torch.equal(exported[name], w)
        adapted += 1
    assert adapted == 7 * TINY["num_hidden_layers"]  # all-linear: q, k, v, o, gate, up, down; not lm_head
    merged = load_model(out)  # the export is a plain HF model, its forward the LoRA policy's
    assert not any("lora_" in n for n in merged.state_dict())  # the adapter is not applied twice
    engine.eval()
    ids, mask, pos, L = _batch(seed=1)
    with torch.no_grad():
        logits = merged(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    lp_merged = torch.log_softmax(logits[:, -L - 1 : -1].float(), -1).gather(-1, ids[:, -L:, None])[..., 0]
    valid = mask[:, -L:].bool()
    torch.testing.assert_close(lp_merged[valid], _log_probs(engine)[valid], rtol=0, atol=1e-5)


def test_adapter_only_export_is_peft_format(tiny_dir, tmp_path):
    from peft import PeftModel

    engine = _engine(tiny_dir, LoraSpec(rank=2, alpha=4, target_modules=("q_proj", "v_proj")))
    _train(engine)
    out = engine.export_hf(tmp_path / "hf") / ADAPTER_SUBDIR
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (2, 4, ["q_proj", "v_proj"])
    assert all(".lora_" in k for k in load_file(str(out / ADAPTER_WEIGHTS)))
    peft_model = PeftModel.from_pretrained(load_model(tiny_dir), str(out))
    ids, mask, pos, _ = _batch(seed=1)
    with torch.no_grad():
        got = peft_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = engine.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_checkpoint_holds_adapter_and_its_optimizer_and_resumes_bitwise(tiny_dir, tmp_path):
    from dapo_core.compute.lora_checkpoint import hf_folder, is_adapter_folder, merge_into

    engine = _engine(tiny_dir)
    _train(engine, steps=1)
    engine.save(tmp_path / "ckpt")
    # no model weights in the checkpoint: the adapter, and the merge gives the export bit for bit
    assert is_adapter_folder(tmp_path / "ckpt") and not list((tmp_path / "ckpt").glob("*.safetensors"))
    exported = load_file(str(engine.export_hf(tmp_path / "hf") / "model.safetensors"))
    merged_dir = merge_into(tmp_path / "ckpt", tmp_path / "merged")
    merged = load_file(str(merged_dir / "model.safetensors"))
    assert merged.keys() == exported.keys() and all(torch.equal(merged[k], exported[k]) for k in merged)
    assert (merged_dir / ADAPTER_SUBDIR / ADAPTER_WEIGHTS).is_file() and (
        merged_dir / "tokenizer.json"
    ).is_file()
    with hf_folder(tmp_path / "ckpt") as folder:
        assert (Path(folder) / "model.safetensors").is_file()
    assert not Path(folder).exists()  # the temporary merge is gone with the context
    _train(engine, steps=1)
    want = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    resumed = _engine(tiny_dir)
    resumed.load(tmp_path / "ckpt")
    _train(resumed, steps=1)
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p, want[n]), n
    from dapo_core.store.state_files import load_state

    optim = load_state(tmp_path / "ckpt", "optim")
    n_adapter = sum(1 for n, p in engine.model.named_parameters() if p.requires_grad)
    assert len(optim["state"]) == n_adapter
    full = make_train_engine("torch", tiny_dir, {"lr": 1e-3}, total_steps=4, grad_clip=1.0)
    with pytest.raises(ValueError, match="lora_rank=4 and this run has lora_rank=0"):
        full.load(tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------- workers
def test_lora_actor_serves_the_reference_and_pushes_its_policy_to_the_rollout(tiny_dir):
    import numpy as np
    import pyarrow as pa

    from dapo_core.compute.workers import ActorWorker, RefWorker, RolloutWorker
    from dapo_core.data import batch as B
    from dapo_core.seeding import uid_factory
    from dapo_core.stages import compute_advantage_table

    prompts = pa.table(
        {
            "prompt_id": pa.array(range(2), pa.int64()),
            "data_source": ["synthetic_arith"] * 2,
            "ground_truth": ["3"] * 2,
            "prompt_ids": pa.array([[1, 10 + i, 11, 12] for i in range(2)], pa.list_(pa.int32())),
        }
    )
    prompts = B.repeat_interleave_prompts(prompts, 4, uid_fn=uid_factory(0, "lora"))
    s = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "do_sample": True}
    roll = RolloutWorker(str(tiny_dir), seed=3, train_sampling=s, val_sampling={**s, "do_sample": False})
    actor_cfg = {"strategy": "torch", "optim": {"lr": 5e-2}, "ppo_mini_batch_size": 2, "ppo_epochs": 1}
    actor = ActorWorker(
        str(tiny_dir), actor_cfg, pad_token_id=0, temperature=1.0, rollout_n=4, total_steps=3, lora=SPEC
    )
    t = actor.compute_log_prob(roll.generate(prompts, gen_step=0))
    t = t.append_column("reward", pa.array([1.0, -1.0, -1.0, 1.0] * 2, pa.float32()))
    t, _ = compute_advantage_table(t, pad_token_id=0, adv_estimator="grpo")
    actor.update_actor(t, global_steps=1)

    ref = RefWorker(str(tiny_dir), pad_token_id=0, temperature=1.0).compute_ref_log_prob(t)
    via_actor = actor.compute_ref_log_prob(t)
    assert via_actor.column("ref_log_probs").equals(ref.column("ref_log_probs"))  # bitwise: the base model
    now = actor.compute_log_prob(t).column("old_log_probs").to_pylist()
    base = ref.column("ref_log_probs").to_pylist()
    assert not all(np.allclose(a, b, atol=1e-4) for a, b in zip(now, base, strict=True))  # it trained

    roll.sync_weights(actor.sync_tensors())  # merged weights under the base names
    t2 = actor.compute_log_prob(roll.generate(prompts, gen_step=5))
    for old, ro in zip(
        t2.column("old_log_probs").to_pylist(), t2.column("rollout_log_probs").to_pylist(), strict=True
    ):
        assert np.allclose(old, ro, atol=1e-5)  # the rollout samples from the trained LoRA policy
