"""Unit tests for dapo_core.store.replay.ReplayBuffer (oldest-first, DAPO filter, staleness drop/wait,
metrics), and the buffer over the column-delta store (row selections, retention)."""

import itertools
import uuid

import numpy as np
import pyarrow as pa
import pytest

from dapo_core.store import RunStore
from dapo_core.store.replay import ReplayBuffer, ReplayError, referenced_steps
from dapo_core.store.retention import apply_retention
from dapo_core.store.stage_files import io_counters

N = 4


def _uid():
    return uuid.uuid4().hex


def _groups(uids, accs, weight_version=0, n=N):
    """One row per trajectory; accs[g] is the list of n acc values of group g."""
    rows = {"uid": [], "sample_idx": [], "acc": [], "weight_version": [], "response_ids": []}
    for u, a in zip(uids, accs, strict=True):
        for i in range(n):
            rows["uid"].append(u)
            rows["sample_idx"].append(i)
            rows["acc"].append(bool(a[i]))
            rows["weight_version"].append(weight_version)
            rows["response_ids"].append([i, len(u)])
    return pa.table(
        {
            "uid": pa.array(rows["uid"]),
            "sample_idx": pa.array(rows["sample_idx"], pa.int32()),
            "acc": pa.array(rows["acc"]),
            "weight_version": pa.array(rows["weight_version"], pa.int64()),
            "response_ids": pa.array(rows["response_ids"], pa.list_(pa.int32())),
        }
    )


_TAGS = itertools.count()


def _add(rb: ReplayBuffer, table: pa.Table, global_steps: int) -> int:
    """Commit ``table`` as a reward stage, as the workers do, and register it as the flow does (add_stage)."""
    uri = rb.store.write_stage(global_steps, f"reward_g{next(_TAGS)}", table)
    return rb.add_stage(uri, global_steps)


MIXED = [1, 0, 1, 0]


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "run")
    yield s
    s.close()


def test_oldest_first_and_group_rows(store):
    rb = ReplayBuffer(store, train_batch_size=2, n=N)
    old = [_uid(), _uid()]
    new = [_uid(), _uid()]
    _add(rb, _groups(new, [MIXED] * 2, weight_version=2), 3)
    _add(rb, _groups(old, [MIXED] * 2, weight_version=0), 1)
    table, m = rb.sample(global_steps=4)
    assert table is not None and table.num_rows == 2 * N
    assert table.column("uid").to_pylist() == [old[0]] * N + [old[1]] * N
    assert table.column("sample_idx").to_pylist() == list(range(N)) * 2
    # staleness = (global_steps - 1) - weight version = 3 - 0
    assert m["training/off_policy/trajectory_staleness/mean"] == 3
    assert m["training/off_policy/trajectory_spans/max"] == 1
    assert m["training/global_step"] == 4
    assert m["training/replay/sampleable_groups"] == 2  # surplus kept
    assert m["refill_needed"] == 0
    table2, _ = rb.sample(global_steps=5)
    assert set(table2.column("uid").to_pylist()) == set(new)
    table3, m3 = rb.sample(global_steps=6)
    assert table3 is None and m3["refill_needed"] == 2


def test_not_enough_returns_none_with_refill(store):
    rb = ReplayBuffer(store, train_batch_size=3, n=N)
    _add(rb, _groups([_uid()], [MIXED]), 1)
    inflight = [_uid()]
    store.register_prompts(inflight, 1)
    store.update_tags(inflight, status="running")  # what the generation task does
    table, m = rb.sample(global_steps=1)
    assert table is None
    assert m["refill_needed"] == 1  # 3 wanted - 1 sampleable - 1 in flight
    assert m["training/replay/inflight_prompts"] == 1
    assert m["must_wait"] is False


def test_dapo_filter_evicts_zero_std_groups(store):
    rb = ReplayBuffer(store, train_batch_size=2, n=N, filter_groups_metric="acc")
    all_right, all_wrong, mixed1, mixed2 = _uid(), _uid(), _uid(), _uid()
    _add(rb, _groups([all_right, all_wrong, mixed1], [[1] * 4, [0] * 4, MIXED]), 1)
    table, m = rb.sample(global_steps=1)
    assert table is None
    assert m["training/filter_groups/evicted_samples"] == 2
    assert m["_dapo_filtered_reward_counts"] == {1.0: 1, 0.0: 1}
    assert m["refill_needed"] == 1
    assert store.count(uid=all_right) == 0 and store.count(uid=all_wrong) == 0  # evicted from ledger
    _add(rb, _groups([mixed2], [[0, 0, 0, 1]]), 1)
    table, m = rb.sample(global_steps=1)
    assert set(table.column("uid").to_pylist()) == {mixed1, mixed2}
    assert m["training/filter_groups/evicted_samples"] == 0


def test_singleton_groups_are_kept_by_filter(store):
    rb = ReplayBuffer(store, train_batch_size=1, n=1, filter_groups_metric="acc")
    _add(rb, _groups([_uid()], [[1]], n=1), 1)
    table, _ = rb.sample(1)
    assert table is not None and table.num_rows == 1


def test_drop_stale_groups(store):
    rb = ReplayBuffer(store, train_batch_size=1, n=N, max_off_policy_threshold=2)
    stale, fresh = _uid(), _uid()
    _add(rb, _groups([stale], [MIXED]), 1)
    _add(rb, _groups([fresh], [MIXED], weight_version=3), 4)
    table, m = rb.sample(global_steps=4)  # span of stale = 4 - 1 + 1 = 4 > 2
    assert table.column("uid").unique().to_pylist() == [fresh]
    assert m["training/off_policy/evicted_samples"] == 1
    assert m["training/off_policy/evicted_samples_staleness/mean"] == 4
    assert m["training/off_policy/evicted_samples_staleness/max"] == 4
    assert m["training/off_policy/trajectory_staleness/max"] == 0
    assert store.count(uid=stale) == 0


def test_wait_strategy_reports_must_wait(store):
    rb = ReplayBuffer(
        store, train_batch_size=1, n=N, max_off_policy_threshold=2, max_off_policy_strategy="wait"
    )
    stale = _uid()
    _add(rb, _groups([stale], [MIXED]), 1)
    late = _uid()
    store.register_prompts([late], global_steps=2, status="running")
    table, m = rb.sample(global_steps=3)  # in-flight span 2 >= threshold
    assert table is None and m["must_wait"] is True
    assert store.count(uid=stale) == N + 1  # nothing evicted
    _add(rb, _groups([late], [MIXED]), 2)
    table, m = rb.sample(global_steps=3)
    assert m["must_wait"] is False and m["training/off_policy/evicted_samples"] == 0
    assert table.column("uid").unique().to_pylist() == [stale]  # stale one kept, oldest first


def test_discard_surplus(store):
    rb = ReplayBuffer(store, train_batch_size=1, n=N, discard_surplus=True)
    a, b, c = _uid(), _uid(), _uid()
    _add(rb, _groups([a, b, c], [MIXED] * 3), 1)
    table, m = rb.sample(global_steps=1)
    assert table.column("uid").unique().to_pylist() == [a]
    assert m["training/filter_groups/discarded_surplus_samples"] == 2
    assert store.count(uid=b) == 0 and store.count(uid=c) == 0
    assert m["refill_needed"] == 1


def test_resample_same_step_returns_same_batch(store):
    rb = ReplayBuffer(store, train_batch_size=2, n=N)
    uids = [_uid() for _ in range(3)]
    _add(rb, _groups(uids, [MIXED] * 3), 1)
    t1, _ = rb.sample(global_steps=1)
    t2, m2 = rb.sample(global_steps=1)
    assert t1.equals(t2) and m2["training/replay/resampled"] == 1
    assert rb.release(1) == 2
    t3, _ = ReplayBuffer(store, train_batch_size=1, n=N).sample(global_steps=2)
    assert t3.num_rows == N
    assert rb.release(2) == 1
    assert store.count() == 0


def test_existing_prompt_keeps_its_global_steps_and_payload(store):
    rb = ReplayBuffer(store, train_batch_size=1, n=N)
    u = _uid()
    store.register_prompts([u], global_steps=2, payloads=[b"prompt-row"])
    store.update_tags([u], status="running")
    _add(rb, _groups([u], [MIXED]), 5)
    tags, payload = store.get(u)
    assert tags["status"] == "finished" and tags["global_steps"] == 2 and payload == b"prompt-row"
    assert store.get(f"{u}_3")[0]["global_steps"] == 2


def test_failed_groups_evicted(store):
    rb = ReplayBuffer(store, train_batch_size=1, n=N)
    bad = _uid()
    store.register_prompts([bad], 1)
    store.update_tags([bad], status="failure")
    table, m = rb.sample(1)
    assert table is None and m["training/rollout_failure/evicted_samples"] == 1
    assert store.count(uid=bad) == 0


def test_validation_partition_never_evicts(store):
    rb = ReplayBuffer(
        store,
        train_batch_size=1,
        n=N,
        filter_groups_metric="acc",
        max_off_policy_threshold=1,
        partition="val",
    )
    u = _uid()
    _add(rb, _groups([u], [[1] * 4]), 1)
    table, m = rb.sample(global_steps=9)
    assert table is not None and m["validation/off_policy/evicted_samples"] == 0
    assert "validation/global_step" in m


def test_add_stage_validation(store):
    rb = ReplayBuffer(store, train_batch_size=1, n=N, filter_groups_metric="score")
    t = _groups([_uid()], [MIXED])
    with pytest.raises(ReplayError, match="'score' is missing"):
        _add(rb, t, 1)
    rb2 = ReplayBuffer(store, train_batch_size=1, n=N)
    with pytest.raises(ReplayError, match="expected n=4"):
        _add(rb2, t.slice(0, 3), 1)
    with pytest.raises(ReplayError, match="weight_version"):
        _add(rb2, t.drop_columns(["weight_version"]), 1)
    with pytest.raises(ValueError, match="must not contain '_'"):
        _add(rb2, _groups(["bad_uid"], [MIXED]), 1)
    with pytest.raises(ReplayError, match="max_off_policy_strategy"):
        ReplayBuffer(store, train_batch_size=1, n=N, max_off_policy_strategy="block")


def test_rows_come_from_many_files_in_order(store):
    rb = ReplayBuffer(store, train_batch_size=6, n=N)
    uids = [_uid() for _ in range(6)]
    for step, chunk in ((1, uids[:2]), (1, uids[2:4]), (2, uids[4:])):
        _add(rb, _groups(chunk, [MIXED] * len(chunk), weight_version=step - 1), step)
    table, m = rb.sample(global_steps=3)
    assert table.column("uid").to_pylist() == [u for u in uids for _ in range(N)]
    assert [r[0] for r in table.column("response_ids").to_pylist()] == table.column("sample_idx").to_pylist()
    assert m["training/off_policy/trajectory_staleness/min"] == 1
    assert m["training/off_policy/trajectory_staleness/max"] == 2


# ----------------------------------------------------------------------------------------------------------
# The replay buffer over the column-delta store: its files are row selections over the stages the groups come
# from (no token-level column read or written again), a sample commits as a selection, and retention keeps
# exactly the steps the buffer (or a kept selection built on it) still references.


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
