"""The replay buffer over the column-delta store: its files are row selections over the stages the groups come
from (no token-level column read or written again), a sample commits as a selection, and retention keeps
exactly the steps the buffer (or a kept selection built on it) still references."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dapo_core.store import RunStore
from dapo_core.store.replay import ReplayBuffer, referenced_steps
from dapo_core.store.retention import apply_retention
from dapo_core.store.stage_files import io_counters

N = 4
TOKENS = 200  # long rows, so that reading a token column would dwarf the small columns


def _uids(step: int, groups: int) -> list[str]:
    return [f"{step:04d}{g:028x}" for g in range(groups)]


def _commit_rollout(store: RunStore, step: int, groups: int, accs: list[list[int]]) -> tuple[str, pa.Table]:
    """prompts_g0 → generate_g0 → reward_g0 at `step` (column deltas, as the workers commit them); returns
    the reward stage's URI and its full view."""
    uids = [u for u in _uids(step, groups) for _ in range(N)]
    rows = len(uids)
    prompts = pa.table(
        {
            "uid": pa.array(uids),
            "sample_idx": pa.array([i % N for i in range(rows)], pa.int32()),
            "prompt_ids": pa.array([[step, i] * (TOKENS // 2) for i in range(rows)], pa.list_(pa.int32())),
        }
    )
    p_uri = store.write_stage(step, "prompts_g0", prompts)
    gen = prompts.append_column(
        "response_ids", pa.array([[i, step] * (TOKENS // 2) for i in range(rows)], pa.list_(pa.int32()))
    ).append_column("weight_version", pa.array([step - 1] * rows, pa.int64()))
    g_uri = store.write_stage(step, "generate_g0", gen, base=p_uri)
    reward = gen.append_column("acc", pa.array([bool(a) for acc in accs for a in acc]))
    return store.write_stage(step, "reward_g0", reward, base=g_uri), reward


MIXED = [1, 0, 1, 0]


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "run")
    yield s
    s.close()


def test_add_stage_and_batch_are_row_selections_that_read_no_token_column(store):
    reward_uri, reward = _commit_rollout(store, 1, 3, [MIXED, [1] * N, MIXED])
    rb = ReplayBuffer(store, train_batch_size=2, n=N, filter_groups_metric="acc")
    io_counters(reset=True)
    wanted = [_uids(1, 3)[0], _uids(1, 3)[2]]
    assert rb.add_stage(reward_uri, 1, uids=wanted) == 2
    io = io_counters()
    assert io["read_bytes"] == 0  # nothing read whole; only small columns, memory-mapped
    token_bytes = reward.column("prompt_ids").nbytes + reward.column("response_ids").nbytes
    assert 0 < io["mapped_bytes"] < token_bytes / 20
    add = store.manifest(1, "replay_add_00000")
    assert add["selection"] and add["file_columns"] == [] and add["base"] == [[1, "reward_g0"]]
    assert add["bytes"] < token_bytes / 20

    selection, metrics = rb.sample_selection(2)
    assert selection is not None and metrics["training/replay/sampleable_groups"] == 0
    io_counters(reset=True)
    store.write_selection(2, "batch", selection.positions, base=selection.bases)
    assert io_counters()["read_bytes"] == 0
    batch = store.manifest(2, "batch")
    assert batch["selection"] and batch["file_columns"] == []
    expected = reward.filter(pa.array([u in wanted for u in reward.column("uid").to_pylist()]))
    assert store.read_stage(2, "batch").equals(expected)
    assert rb.read(selection).equals(expected)  # what ReplayBuffer.sample returns


def test_rows_of_several_steps_in_oldest_first_order(store):
    rb = ReplayBuffer(store, train_batch_size=3, n=N)
    new_uri, new = _commit_rollout(store, 2, 2, [MIXED] * 2)
    old_uri, old = _commit_rollout(store, 1, 2, [MIXED] * 2)
    rb.add_stage(new_uri, 2)
    rb.add_stage(old_uri, 1)
    selection, _ = rb.sample_selection(3)
    assert selection is not None and len(selection.bases) == 2
    store.write_selection(3, "batch", selection.positions, base=selection.bases)
    expected = pa.concat_tables([old, new.slice(0, N)])
    assert store.read_stage(3, "batch").equals(expected)
    again, m = rb.sample_selection(3)  # crash-replay of the step: the same rows
    assert again is not None and m["training/replay/resampled"] == 1
    assert again.bases == selection.bases and np.array_equal(again.positions, selection.positions)


def test_add_stage_keeps_the_batch_contract(store):
    reward_uri, _ = _commit_rollout(store, 1, 2, [MIXED] * 2)
    with pytest.raises(ValueError, match="expected n=3"):
        ReplayBuffer(store, train_batch_size=1, n=3).add_stage(reward_uri, 1)
    with pytest.raises(ValueError, match="filter_groups metric column 'score'"):
        ReplayBuffer(store, train_batch_size=1, n=N, filter_groups_metric="score").add_stage(reward_uri, 1)
    assert store.committed_stages(1) == ["generate_g0", "prompts_g0", "reward_g0"]  # nothing half-added


def test_retention_keeps_the_steps_the_buffer_references_and_deletes_the_rest(store):
    rb = ReplayBuffer(store, train_batch_size=2, n=N)
    uri1, _ = _commit_rollout(store, 1, 2, [MIXED] * 2)
    uri2, step2 = _commit_rollout(store, 2, 2, [MIXED] * 2)
    rb.add_stage(uri1, 1)
    rb.add_stage(uri2, 2)
    selection, _ = rb.sample_selection(3)  # the step-1 groups, oldest first
    assert selection is not None
    store.write_selection(3, "batch", selection.positions, base=selection.bases)
    assert referenced_steps(store) == {1, 2}
    assert apply_retention(store, 2, 0, referenced_steps(store)) == []

    assert rb.release(3) == 2  # a checkpoint covers step 3's consumption: the step-1 groups leave the ledger
    assert referenced_steps(store) == {2}
    # checkpoint 2: step 1 is no longer pinned, but the kept batch of step 3 is built on its files
    assert apply_retention(store, 2, 0, referenced_steps(store)) == []
    assert store.read_stage(3, "batch").num_rows == 2 * N
    # checkpoint 3: step 3 and with it the last reference to step 1 go; step 2 is still the buffer's
    assert apply_retention(store, 3, 0, referenced_steps(store)) == [1, 3]
    assert store.steps() == [2]
    for _, tags in store.items("train", is_prompt=False):
        store.read_uri(tags["uri"])
    table, _ = rb.sample(4)
    assert table is not None and table.equals(step2)
