"""LoRA on the FSDP2 engine (gloo, two real processes, one thread each): the adapters sharded with their
layers, an update equal to the torch engine's, the frozen base shards untouched, the reference through
disabled adapters, the merged push and export, and an adapter-only checkpoint that resumes bitwise."""

from __future__ import annotations

import traceback

import pytest
import torch

from dapo_core.compute.lora import ADAPTER_SUBDIR, ADAPTER_WEIGHTS, LoraSpec
from dapo_core.compute.models import build_tiny_model
from tests.helpers import spawn_ranks
from tests.unit.dapo_core.compute.engines.test_fsdp2_train import _base, _update
from tests.unit.dapo_core.compute.engines.test_train import OPTIM, TINY, make_batch

SPEC = LoraSpec(rank=4, alpha=8)


def _engine(strategy: str, model: str):
    from dapo_core.compute.engines.train import make_train_engine

    return make_train_engine(strategy, model, OPTIM, total_steps=5, grad_clip=1.0, seed=3, lora=SPEC)


def _ref_log_probs(engine) -> torch.Tensor:
    b = make_batch(seed=7)
    engine.eval()
    with engine.ref_mode():
        lp, _ = engine.forward(b["input_ids"], b["attention_mask"], b["position_ids"], 6)
    engine.train()
    return lp


def _rank(rank: int, port: int, model: str, ckpt: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        from dapo_core.compute import dist as dpd
        from dapo_core.compute.engines.fsdp2_train import SHARDS
        from dapo_core.compute.lora import adapter_state

        dp = dpd.init_data_parallel(rank, 2, "127.0.0.1", port, "cpu")
        dpd.set_current(dp)
        eng = _engine("fsdp2", model)
        params = dict(eng.model.named_parameters())
        trainable = {n for n, p in params.items() if p.requires_grad}
        in_optim = {id(p) for g in eng.optimizer.param_groups for p in g["params"]}
        frozen = {n: p.to_local().clone() for n, p in params.items() if n not in trainable}
        eng.lr_step()
        metrics = _update(eng, make_batch(), dp)
        checks = {
            "only adapters train": bool(trainable) and all(".lora_" in n for n in trainable),
            "only adapters in the optimizer": in_optim == {id(params[n]) for n in trainable}
            and len(eng.optimizer.state) == len(trainable),
            "adapters sharded": all(params[n].to_local().shape[0] < params[n].shape[0] for n in trainable),
            "base shards bitwise unchanged": all(
                torch.equal(params[n].to_local(), t) for n, t in frozen.items()
            ),
            "no base gradients": all(params[n].grad is None for n in frozen),
        }
        merged = eng.state_dict_for_sync()
        pushed = {n: t.clone() for n, t in eng.iter_sync_tensors() if not isinstance(t, str)}
        bf16 = {n: t.clone() for n, t in eng.iter_sync_tensors(torch.bfloat16) if not isinstance(t, str)}
        adapters = adapter_state(eng.peft, SHARDS)
        ref_lp = _ref_log_probs(eng)
        eng.save(ckpt)
        second = make_batch(seed=3)
        _update(eng, second, dp)
        after = {n: p.to_local().clone() for n, p in params.items() if n in trainable}
        eng.load(ckpt)
        _update(eng, second, dp)
        checks["resume bitwise"] = all(torch.equal(params[n].to_local(), t) for n, t in after.items())
        checks["push equals state dict"] = rank != 0 or all(torch.equal(pushed[k], merged[k]) for k in pushed)
        checks["bf16 push is the merged weights cast"] = rank != 0 or all(
            torch.equal(bf16[k], merged[k].to(torch.bfloat16)) for k in bf16
        )
        if rank == 0:  # numpy, not tensors: a tensor would travel as shared memory this process frees
            arrays = [{k: v.numpy() for k, v in d.items()} for d in (merged, adapters)]
            queue.put(("ok", checks, metrics, *arrays, ref_lp.numpy()))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


@pytest.mark.timeout(600)
def test_fsdp2_lora_dp2_equals_torch_engine_merges_and_resumes_bitwise(tmp_path):
    from safetensors.torch import load_file

    from dapo_core.compute.lora import adapter_state

    model = str(build_tiny_model(tmp_path / "tiny", TINY, seed=1))
    ckpt = tmp_path / "ckpt"
    result = spawn_ranks(_rank, model, str(ckpt))
    assert result[0] == "ok", result[1]
    _, checks, metrics, merged, adapters, ref_lp = result
    assert all(checks.values()), checks
    merged, adapters = ({k: torch.from_numpy(v) for k, v in d.items()} for d in (merged, adapters))

    # one torch-engine process on the same batch: the same adapter init, update and merged weights
    torch.set_num_threads(1)
    ref = _engine("torch", model)
    ref.lr_step()
    expected = _update(ref, make_batch(), None)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    want_adapters = adapter_state(ref.peft)
    assert adapters.keys() == want_adapters.keys()
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 1e-4 for k, v in adapters.items())
    # Float32 gradients summed in another order over two ranks: Adam's normalised step turns the rounding of
    # a near-zero gradient into a few 1e-3 of a step (lr 5e-3) at most; one fsdp2 process matches bitwise.
    diff = {k: float((adapters[k] - want_adapters[k]).abs().max()) for k in adapters}
    assert max(diff.values()) < 5e-5, sorted(diff.items(), key=lambda kv: -kv[1])[:3]
    want = ref.state_dict_for_sync()
    assert merged.keys() == want.keys()
    assert max(float((merged[k] - want[k]).abs().max()) for k in want) < 5e-5
    torch.testing.assert_close(torch.from_numpy(ref_lp), _ref_log_probs(ref), rtol=0, atol=1e-6)

    # merged = base + B·A·alpha/r under the base names, in the push and in rank 0's export
    base = _base(model)
    adapted = 0
    for name, w in base.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        if f"{stem}.lora_A.weight" not in adapters:
            assert torch.equal(merged[name], w), name
            continue
        a, b = adapters[f"{stem}.lora_A.weight"], adapters[f"{stem}.lora_B.weight"]
        torch.testing.assert_close(merged[name], w + (b @ a) * SPEC.scaling, rtol=0, atol=1e-6)
        adapted += 1
    assert adapted == 7 * TINY["num_hidden_layers"]
    # the checkpoint holds no model weights; its adapter merged into the base gives the pushed weights
    from dapo_core.compute.lora_checkpoint import is_adapter_folder, merge_into

    assert is_adapter_folder(ckpt) and not (ckpt / "model.safetensors").exists()
    exported = load_file(str(merge_into(ckpt, tmp_path / "merged") / "model.safetensors"))
    assert exported.keys() == merged.keys() - {"lm_head.weight"}
    for k in exported:  # one process's whole-tensor merge against the ranks' row blocks
        torch.testing.assert_close(exported[k], merged[k], rtol=0, atol=1e-6)
    saved_adapter = load_file(str(ckpt / ADAPTER_SUBDIR / ADAPTER_WEIGHTS))
    assert (
        all(torch.equal(saved_adapter[k], adapters[k]) for k in adapters)
        and saved_adapter.keys() == adapters.keys()
    )

    # the checkpoint holds the adapter shards and their AdamW state alone
    from dapo_core.store.state_files import load_state

    for r in range(2):
        shards = load_file(str(ckpt / f"model.rank{r}.safetensors"))
        assert shards and all(".lora_" in k for k in shards)
        assert set(load_state(ckpt, f"optim.rank{r}")) == set(shards)
