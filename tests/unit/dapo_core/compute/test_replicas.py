"""Rollout replicas (dapo_core/compute/replicas.py): the split by whole groups and the gather in input order,
the replica layout and its refusals, and real in-process replicas (a tiny HF model): M=2 generates the rows
M=1 does, commits shares plus a row selection through the real run store, every replica receives pushed
weights and reports their version, and a stale replica is never used."""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_core.compute.cluster import Cluster
from dapo_core.compute.replicas import (
    RolloutReplicas,
    StaleWeights,
    gather_positions,
    replica_layout,
    replica_role,
    split_groups,
)
from dapo_core.compute.rpc import proxy
from dapo_core.compute.workers.rollout import RolloutWorker
from dapo_core.data import batch as B
from dapo_core.errors import DapoUserError
from dapo_core.seeding import uid_factory
from dapo_core.store.jobs import StageJob
from dapo_core.store.stage_files import StageFiles
from tests.helpers import tiny_model_cfg

MAX_NEW = 6
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": MAX_NEW, "do_sample": True}


# ------------------------------------------------------------------------------------ split and gather
@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_split_keeps_groups_whole_loses_no_row_and_gathers_in_input_order(m):
    rng = np.random.default_rng(0)
    groups = [f"u{g}" for g in rng.integers(0, 6, size=40)]  # groups interleaved, uneven sizes
    costs = rng.integers(1, 50, size=40).astype(float)
    shares = split_groups(groups, costs, m)
    assert len(shares) == m
    allrows = np.concatenate(shares)
    assert sorted(allrows.tolist()) == list(range(40))  # no row lost or duplicated
    owner = {}
    for r, s in enumerate(shares):
        assert np.all(np.diff(s) > 0)  # input order inside a share
        for i in s:
            assert owner.setdefault(groups[i], r) == r  # a group never spans two shares
    pos = gather_positions(shares, 40)
    assert np.array_equal(allrows[pos], np.arange(40))
    if m > len(set(groups)):
        assert sum(len(s) == 0 for s in shares) == m - len(set(groups))


def test_split_balances_expected_tokens_largest_group_first():
    # group costs 9, 5, 4, 3, 3: largest first to the least loaded share gives loads 9+3=12 and 5+4+3=12
    groups = ["a"] * 3 + ["b"] + ["c"] * 2 + ["d"] + ["e"]
    costs = [3, 3, 3, 5, 2, 2, 3, 3]
    shares = split_groups(groups, costs, 2)
    loads = [sum(costs[i] for i in s) for s in shares]
    assert loads == [12, 12]
    # a (9) -> 0, b (5) -> 1, c (4) -> 1, d (3) -> 0 (tied at 9: the lower share), e (3) -> 1
    assert shares[0].tolist() == [0, 1, 2, 6] and shares[1].tolist() == [3, 4, 5, 7]
    assert split_groups(groups, costs, 2)[1].tolist() == shares[1].tolist()  # deterministic


def test_gather_refuses_shares_that_lose_or_duplicate_a_row():
    with pytest.raises(RuntimeError, match="not each of the 4 input rows once"):
        gather_positions([np.array([0, 1]), np.array([1, 3])], 4)
    with pytest.raises(RuntimeError, match="not each"):
        gather_positions([np.array([0, 1, 2])], 4)


# ------------------------------------------------------------------------------------------- the layout
def test_layout_counts_replicas_and_refuses_what_cannot_run_with_one_paragraph():
    assert replica_layout(1, 1, 1, "hf", "cpu").count == 1
    cpu2 = replica_layout(1, 2, 1, "hf", "cpu")
    assert (cpu2.count, cpu2.num_gpus, cpu2.engine_opts) == (2, 0.0, {})
    gpu = replica_layout(16, 8, 4, "vllm", "cuda")  # the 32B recipe: 128 GPUs, TP 4
    assert (gpu.count, gpu.num_gpus, gpu.tensor_parallel) == (32, 4.0, 4)
    assert gpu.engine_opts == {"distributed_executor_backend": "mp"}
    assert replica_layout(1, 8, 1, "vllm", "cuda").engine_opts == {}
    for args, words in (
        ((1, 6, 4, "vllm", "cuda"), ("does not divide the 6 devices", "trainer.n_gpus_per_node")),
        ((1, 2, 2, "vllm", "cpu"), ("need GPUs", "tensor_model_parallel_size=1")),
        ((1, 2, 2, "hf", "cuda"), ("needs the vllm engine", "rollout.name=vllm")),
    ):
        with pytest.raises(DapoUserError) as err:
            replica_layout(*args)
        text = str(err.value)
        assert "\n" not in text and "Fix:" in text and "tensor_model_parallel_size" in text
        assert all(w in text for w in words), text


def test_config_check_refuses_a_tp_that_does_not_divide_before_anything_starts():
    from dapo_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="does not divide the 3 devices"):
        load_config(
            "configs/tiny_cpu.yaml",
            ["trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
        )
    with pytest.raises(ConfigError, match="needs the vllm engine"):
        load_config(
            "configs/tiny_cpu.yaml",
            ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
        )
    assert load_config("configs/tiny_cpu.yaml").trainer.n_gpus_per_node == 1  # the CPU default: one replica


# ------------------------------------------------------------------------------ real in-process replicas
@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from dapo_core.compute.models import build_tiny_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("replicas")
    return str(build_tiny_model(root / "m", tiny_model_cfg(hidden_size=32, intermediate_size=64), seed=0))


def _replicas(model_path: str, m: int, run_id: str) -> tuple[Cluster, RolloutReplicas]:
    cluster = Cluster(run_id, use_ray=False)
    factory = functools.partial(
        RolloutWorker, model_path, seed=3, train_sampling=SAMPLING, val_sampling=SAMPLING
    )
    names = [replica_role(i) for i in range(m)]
    workers = [proxy(cluster.create(n, factory), RolloutWorker) for n in names]
    return cluster, RolloutReplicas(workers, max_new_tokens=MAX_NEW, names=names, placement=cluster.placement)


class _Tensors:
    """A weight source standing in for the actor in these in-process tests: `sync_tensors` as the actor
    yields them."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def sync_tensors(self):
        yield from self.weights.items()


def _source(cluster: Cluster, weights: dict[str, torch.Tensor], name: str) -> _Tensors:
    return proxy(cluster.create(name, functools.partial(_Tensors, weights)), _Tensors)


def _prompts(model_path: str, num: int = 7) -> pa.Table:
    from dapo_core.compute.models import load_tokenizer

    tok = load_tokenizer(model_path)
    texts = [f"{i}+{(3 * i) % 11}=" + "1" * (i % 4) for i in range(num)]  # uneven prompt lengths
    return pa.table(
        {
            "prompt_id": pa.array(range(num), pa.int64()),
            "data_source": ["t"] * num,
            "ground_truth": [str(i) for i in range(num)],
            "prompt_ids": pa.array([tok.encode(t) for t in texts], pa.list_(pa.int32())),
        }
    )


def _job(root, stage: str, input_uri: str, n: int) -> StageJob:
    return StageJob(
        root=str(root), step=1, stage=stage, input_uri=input_uri, timer="gen", schema="generate", n=n,
        vocab_size=10_000, max_prompt_length=64, max_response_length=MAX_NEW,
    )  # fmt: skip


GEN = ["response_ids", "rollout_log_probs", "finish_reason", "weight_version", "gen_step"]


def test_two_replicas_generate_and_commit_the_rows_one_replica_does(model_path, tmp_path):
    n = 3
    prompts = _prompts(model_path)
    table = B.repeat_interleave_prompts(prompts, n, uid_fn=uid_factory(1, "train", 1, 0))
    outs = {}
    for m in (1, 2):
        root = tmp_path / f"m{m}"
        files = StageFiles(root)
        uri = files.write_stage(1, "prompts_g0", table)
        val_uri = files.write_stage(1, "val_prompts", prompts)
        cluster, reps = _replicas(model_path, m, f"rep{m}")
        try:
            assert len(reps) == m
            in_memory = reps.generate(table, 5)
            gen_uri, metrics = reps.generate_stage(_job(root, "generate_g0", uri, n), 5)
            val_uri, _ = reps.validation_stage(_job(root, "val_generate", val_uri, n), 5, n=n, uid_seed=1)
        finally:
            cluster.shutdown()
        stored = files.read_uri(gen_uri)
        assert stored.column("uid").equals(table.column("uid"))  # input order, no row lost or duplicated
        assert stored.column("sample_idx").equals(table.column("sample_idx"))
        for col in GEN:  # the same shares as the in-memory split: bit for bit
            assert stored.column(col).equals(in_memory.column(col)), col
        outs[m] = (stored, metrics, files.read_uri(val_uri), files.committed_stages(1))
    one, two = outs[1], outs[2]
    for col in ("uid", "sample_idx", "prompt_ids", *GEN):  # the tokens do not depend on the split
        if col == "rollout_log_probs":  # a share pads to its own longest prompt: equal to float precision
            for a, b in ((one[0], two[0]), (one[2], two[2])):
                la, lb = (np.concatenate(t.column(col).to_numpy(zero_copy_only=False)) for t in (a, b))
                np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5)
            continue
        assert two[0].column(col).equals(one[0].column(col)), col
        assert two[2].column(col).equals(one[2].column(col)), f"validation {col}"
    assert {k: v for k, v in two[1].items() if not k.startswith("timing")} == {
        k: v for k, v in one[1].items() if not k.startswith("timing")
    }
    assert one[3] == ["generate_g0", "prompts_g0", "val_generate", "val_prompts"]
    shares = {"generate_g0_r0of2", "generate_g0_r1of2", "val_generate_r0of2", "val_generate_r1of2"}
    assert set(two[3]) == set(one[3]) | shares
    files = StageFiles(tmp_path / "m2")
    parts = [files.read_stage(1, f"generate_g0_r{i}of2").column("uid").to_pylist() for i in (0, 1)]
    assert parts[0] and parts[1] and not set(parts[0]) & set(parts[1])  # whole groups on each replica
    assert files.manifest(1, "generate_g0")["selection"]  # the stage itself is only row ids


def test_weights_reach_every_replica_with_their_version_and_a_stale_one_is_never_used(model_path, tmp_path):
    from safetensors.torch import load_file

    n = 2
    table = B.repeat_interleave_prompts(_prompts(model_path, 4), n, uid_fn=uid_factory(1, "train", 1, 0))
    files = StageFiles(tmp_path)
    uri = files.write_stage(1, "prompts_g0", table)
    weights = {k: v * 1.5 for k, v in load_file(f"{model_path}/model.safetensors").items()}
    cluster, reps = _replicas(model_path, 2, "stale")
    try:
        before = reps.generate(table, 0)
        assert reps.push_from(_source(cluster, weights, "src4"), 4) == 4
        assert reps.versions == [4, 4] and [w.weight_version() for w in reps.workers] == [4, 4]
        after = reps.generate(table, 0)
        assert set(after.column("weight_version").to_pylist()) == {4}
        assert not after.column("rollout_log_probs").equals(before.column("rollout_log_probs"))
        # every replica got the new weights: rows of both shares differ from the old weights' rows
        shares = split_groups(table.column("uid").to_pylist(), [1] * table.num_rows, 2)
        lp_before, lp_after = before.column("rollout_log_probs"), after.column("rollout_log_probs")
        for s in shares:
            assert any(lp_before[int(i)] != lp_after[int(i)] for i in s)

        # replica 1 misses an update (its own sync bumps its version past the stamp): nothing is generated
        reps.workers[1].sync_weights(weights)
        reps.versions[1] = reps.workers[1].weight_version()
        with pytest.raises(StaleWeights, match=r"rollout-1 \(version 5\).*weight version 4"):
            reps.generate_stage(_job(tmp_path, "generate_g0", uri, n), 0)
        assert files.committed_stages(1) == ["prompts_g0"]  # no share was generated or committed
        # the replica checks the version itself too, whatever the driver believes
        reps.versions[1] = 4
        with pytest.raises(StaleWeights, match="holds weight version 5, but the driver expects version 4"):
            reps.generate_stage(_job(tmp_path, "generate_g0", uri, n), 0)
        assert not files.is_committed(1, "generate_g0")
        # a failed push leaves every replica unconfirmed until a push succeeds
        with pytest.raises(KeyError, match=r"no\.such\.weight"):
            reps.push_from(_source(cluster, {"no.such.weight": torch.zeros(1)}, "bad"), 5)
        with pytest.raises(StaleWeights, match=r"rollout-0 \(version None\), rollout-1 .*did not confirm"):
            reps.generate(table, 0)
        reps.push_from(_source(cluster, weights, "src5"), 5)
        out_uri, _ = reps.generate_stage(_job(tmp_path, "generate_g0", uri, n), 0)
        assert set(files.read_uri(out_uri).column("weight_version").to_pylist()) == {5}
        info = reps.workers_info()
        assert [(w["role"], w["rank"], w["name"]) for w in info] == [
            ("rollout", 0, "rollout-0"),
            ("rollout", 1, "rollout-1"),
        ]
    finally:
        cluster.shutdown()
