"""FSDP2 data parallelism on CPU (gloo, two real processes, one thread each): the row split, the global
token-mean update equal to one process's, the ordered gather, and sharded checkpoints."""

from __future__ import annotations

import traceback
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from dapo_core.compute.dist import dp_split
from dapo_core.compute.models import build_tiny_model
from tests.helpers import spawn_ranks
from tests.unit.dapo_core.compute.engines.test_train import OPTIM, TINY, make_batch, token_mean_pg_loss


def test_dp_split_balances_tokens_keeps_groups_and_loses_no_row():
    costs = [10, 1, 1, 9, 5, 5, 2, 7]
    groups = ["a", "b", "b", "c", "d", "d", "e", "f"]
    parts = dp_split(costs, 2, groups)
    assert sorted(r for p in parts for r in p) == list(range(8))
    assert all(p == sorted(p) for p in parts)
    for g in set(groups):  # a group's rows land on one rank
        rows = {i for i, x in enumerate(groups) if x == g}
        assert any(rows <= set(p) for p in parts), g
    loads = [sum(costs[r] for r in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 2, loads
    assert parts == dp_split(costs, 2, groups)  # deterministic: every rank computes the same split
    assert dp_split([3], 2) == [[0], []]


def _update(engine, batch, dp):
    from dapo_core.compute.engines.ppo import ppo_update

    return ppo_update(
        engine, batch, loss_fn=token_mean_pg_loss, mini_batch_size=4, micro_batch_size=3, epochs=1, dp=dp
    )


def _rank(rank: int, port: int, model: str, out: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        from dapo_core.compute import dist as dpd
        from dapo_core.compute.engines.train import make_train_engine

        dp = dpd.init_data_parallel(rank, 2, "127.0.0.1", port, "cpu")
        dpd.set_current(dp)
        eng = make_train_engine("fsdp2", model, OPTIM, total_steps=5, grad_clip=1.0)
        eng.lr_step()
        metrics = _update(eng, make_batch(), dp)
        weights = eng.state_dict_for_sync()
        parts = [[0, 2, 3], [1, 4]]
        mine = pa.table({"row": pa.array(parts[rank], type=pa.int64())})
        gathered = dpd.gather_table(dp, mine, parts)
        eng.save(out)
        eng.load(out)
        again = eng.state_dict_for_sync()
        bf16 = torch.bfloat16
        mixed = make_train_engine(
            "fsdp2", model, OPTIM, total_steps=5, grad_clip=1.0, compute_dtype=bf16, reduce_dtype=bf16
        )
        mixed.lr_step()
        mixed_metrics = _update(mixed, make_batch(), dp)
        mixed_weights = mixed.state_dict_for_sync()
        # bf16 compute with the default reduce: gradients are averaged over the ranks in float32, so the
        # mean of two ranks' bf16 gradients keeps bits a bf16 reduce would round away
        default = make_train_engine("fsdp2", model, OPTIM, total_steps=5, grad_clip=1.0, compute_dtype=bf16)
        ids = torch.arange(3 + rank, 40 + rank).reshape(1, -1) % 30
        default.model(input_ids=ids).logits.float().pow(2).mean().backward()
        grads = torch.cat(
            [p.grad.to_local().flatten() for p in default.model.parameters() if p.grad is not None]
        )
        beyond_bf16 = int((grads != grads.to(bf16).float()).sum())
        synced = {n: t.clone() for n, t in eng.iter_sync_tensors(bf16) if not isinstance(t, str)}
        if rank == 0:
            assert gathered is not None
            assert all(
                synced[k].dtype == bf16 and torch.equal(synced[k], weights[k].to(bf16)) for k in synced
            )
            arrays = [{k: v.numpy() for k, v in w.items()} for w in (weights, again, mixed_weights)]
            rows = gathered.column("row").to_pylist()
            queue.put(("ok", metrics, arrays[0], rows, arrays[1], mixed_metrics, arrays[2], beyond_bf16))
        else:
            assert gathered is None and weights == {}
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def _single(_rank: int, _port: int, model: str, ckpt: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        from dapo_core.compute.engines.train import make_train_engine

        eng = make_train_engine("fsdp2", model, OPTIM, total_steps=5, grad_clip=1.0)
        try:
            eng.load(ckpt)
        except Exception as exc:
            queue.put(("refused", f"{type(exc).__name__}: {exc}"))
            return
        queue.put(("loaded", ""))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


@pytest.mark.timeout(600)
def test_fsdp2_dp2_update_equals_one_process_and_checkpoints_by_shard(tmp_path):
    from dapo_core.compute.engines.train import make_train_engine

    model = str(build_tiny_model(tmp_path / "tiny", TINY, seed=1))
    ckpt = tmp_path / "ckpt"
    result = spawn_ranks(_rank, model, str(ckpt))
    assert result[0] == "ok", result[1]
    _, metrics, weights, rows, again, mixed_metrics, mixed, beyond_bf16 = result
    assert beyond_bf16 > 0, "the gradients were reduced in bf16"
    weights, again, mixed = ({k: torch.from_numpy(v) for k, v in w.items()} for w in (weights, again, mixed))

    ref = make_train_engine("torch", model, OPTIM, total_steps=5, grad_clip=1.0)
    ref.lr_step()
    expected = _update(ref, make_batch(), None)
    want = ref.state_dict_for_sync()
    assert weights.keys() == want.keys()
    moved = max(float((want[k] - ref_w).abs().max()) for k, ref_w in _base(model).items())
    diff = max(float((weights[k] - want[k]).abs().max()) for k in want)
    assert moved > 1e-3 and diff < 1e-5, (moved, diff)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    assert rows == [0, 1, 2, 3, 4]  # the gather puts every rank's rows back in input order
    assert all(torch.equal(again[k], weights[k]) for k in weights)  # save + load restores the shards
    # bf16 mixed precision (bf16 gathers and reduce-scatter): float32 shards, an update close to float32's
    assert all(v.dtype == torch.float32 for v in mixed.values())
    assert mixed_metrics["actor/grad_norm"] != metrics["actor/grad_norm"]
    assert mixed_metrics["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=0.05)
    base = _base(model)
    step = [torch.cat([(w[k] - base[k]).flatten() for k in base]) for w in (weights, mixed)]
    assert float(torch.nn.functional.cosine_similarity(*step, dim=0)) > 0.9
    from safetensors.torch import load_file

    exported = load_file(str(ckpt / "model.safetensors"))  # streamed by rank 0, tensor by tensor
    assert exported.keys() == weights.keys() - {"lm_head.weight"}
    assert all(torch.equal(exported[k], weights[k]) for k in exported)
    names = sorted(p.name for p in ckpt.glob("model.rank*.safetensors"))
    assert names == ["model.rank0.safetensors", "model.rank1.safetensors"]

    # a different world size is refused with the keys to change
    outcome = spawn_ranks(_single, model, str(ckpt), world=1, timeout_s=300)
    assert outcome[0] == "refused", outcome
    assert "2 shards" in outcome[1] and "trainer.n_gpus_per_node" in outcome[1], outcome[1]


def _base(model: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    base = load_file(str(Path(model) / "model.safetensors"))
    if "lm_head.weight" not in base:
        base["lm_head.weight"] = base["model.embed_tokens.weight"]
    return base


CRITIC = {
    "optim": {"lr": 1e-3},
    "ppo_mini_batch_size": 2,
    "ppo_epochs": 1,
    "cliprange_value": 0.2,
    "use_dynamic_bsz": True,
    "ppo_max_token_len_per_gpu": 40,
    "model": {},
}
"""Token-budget micro-batches (two padded rows each), so the ranks run unequal numbers of micro-batches."""


def _critic_run(model: str, ckpt: str) -> tuple[list, dict, dict, dict, bool]:
    """Values, two updates, then save / third update / load / third update again: (values, metrics of the
    second update, full weights after it, weights after the third update, whether the reload repeated it
    bit for bit). Every rank must call it; the tensors are rank 0's."""
    from torch.distributed.tensor import DTensor

    from dapo_core.compute.workers.critic import CriticWorker
    from tests.unit.dapo_core.compute.workers.test_critic import ragged_table

    def full(w: CriticWorker) -> dict[str, torch.Tensor]:
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in w.model.state_dict().items()
        }

    w = CriticWorker(model, CRITIC, pad_token_id=0, rollout_n=4, seed=1, total_steps=3)
    table = ragged_table(8, seed=5)
    out = w.compute_values(table.drop_columns(["values"]))  # rank 0 gathers the rows' values
    values = out.column("values").to_pylist() if "values" in out.column_names else []
    w.update_critic(table, 1)  # the value head starts at zero: the backbone gets gradients from the second
    metrics = w.update_critic(table, 2)
    weights = full(w)
    w.save_checkpoint(ckpt)
    w.update_critic(table, 3)
    third = full(w)
    w.load_checkpoint(ckpt)
    w.update_critic(table, 3)
    again = full(w)
    return values, metrics, weights, third, all(torch.equal(again[k], third[k]) for k in third)


def _critic_rank(rank: int, port: int, model: str, out: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        from dapo_core.compute import dist as dpd

        dpd.set_current(dpd.init_data_parallel(rank, 2, "127.0.0.1", port, "cpu"))
        import dapo_core.compute.workers.critic as critic_module

        def whole_model(*args, **kwargs):
            raise AssertionError("a sharded critic rank loaded the whole model")

        critic_module.load_model = whole_model  # a rank reads its rows only (meta build + sharded load)
        result = _critic_run(model, out)
        if rank == 0:  # numpy, not tensors: a tensor would travel as shared memory this process frees
            values, metrics, weights, third, reloaded = result
            arrays = [{k: v.numpy() for k, v in w.items()} for w in (weights, third)]
            queue.put(("ok", values, metrics, *arrays, reloaded))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


@pytest.mark.timeout(600)
def test_critic_dp2_values_update_and_sharded_checkpoint_equal_one_process(tmp_path):
    """Data-parallel critic: two FSDP2 ranks give one process's values, value-loss update (the loss normalised
    over the whole mini-batch's tokens) and weights; each rank checkpoints its shards and a reload repeats
    the next update exactly."""
    model = str(build_tiny_model(tmp_path / "tiny", TINY, seed=1))
    result = spawn_ranks(_critic_rank, model, str(tmp_path / "dp2"))
    assert result[0] == "ok", result[1]
    _, values, metrics, weights, third, reloaded = result
    weights, third = ({k: torch.from_numpy(v) for k, v in w.items()} for w in (weights, third))
    want_values, want_metrics, want, want_third, want_reloaded = _critic_run(model, str(tmp_path / "dp1"))

    for x, y in zip(values, want_values, strict=True):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
    base = _base(model)
    moved = max(
        float((want[f"backbone.{k[len('model.') :]}"] - base[k]).abs().max())
        for k in base
        if k.startswith("model.")
    )
    diff = max(float((weights[k] - want[k]).abs().max()) for k in want)
    diff3 = max(float((third[k] - want_third[k]).abs().max()) for k in want_third)
    assert moved > 1e-4 and diff < 1e-5 and diff3 < 1e-5, (moved, diff, diff3)
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-4, abs=1e-6), key
    assert reloaded and want_reloaded
    assert sorted(p.name for p in (tmp_path / "dp2").glob("critic.rank*.tensors")) == [
        "critic.rank0.tensors",
        "critic.rank1.tensors",
    ]

    from dapo_core.compute.engines.fsdp2_train import ShardedCheckpointMismatch
    from dapo_core.compute.workers.critic import CriticWorker

    single = CriticWorker(model, CRITIC, pad_token_id=0, rollout_n=4, seed=1, total_steps=3)
    with pytest.raises(ShardedCheckpointMismatch, match="written by 2 data-parallel rank"):
        single.load_checkpoint(str(tmp_path / "dp2"))
