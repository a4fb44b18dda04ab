"""Tests for dapo_core.data.batch: Arrow rows ⇄ tensors, row operations, Karmarkar–Karp balancing."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.data import batch as B
from dapo_core.seeding import uid_factory

torch.set_num_threads(1)

LI32 = pa.list_(pa.int32())
LF32 = pa.list_(pa.float32())


def make_table(prompts, responses, logps=None, uids=None):
    """A minimal batch with the given prompt/response token lists."""
    n = len(prompts)
    cols = {
        "uid": uids or [f"u{i}" for i in range(n)],
        "prompt_ids": pa.array(prompts, LI32),
        "response_ids": pa.array(responses, LI32),
    }
    if logps is not None:
        cols["rollout_log_probs"] = pa.array(logps, LF32)
    return pa.table(cols)


rows_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(1, 50), min_size=0, max_size=6),
        st.lists(st.integers(1, 50), min_size=0, max_size=6),
    ),
    min_size=1,
    max_size=8,
)


# ------------------------------------------------------------------ worked example


def test_to_padded_worked_example():
    t = make_table([[1, 2, 3], [4]], [[5], [6, 7, 8]], [[-1.0], [-0.5, -0.25, -2.0]])
    d = B.to_padded(t, 0, columns=["rollout_log_probs"])
    assert d["prompts"].tolist() == [[1, 2, 3], [0, 0, 4]]
    assert d["responses"].tolist() == [[5, 0, 0], [6, 7, 8]]
    assert d["input_ids"].tolist() == [[1, 2, 3, 5, 0, 0], [0, 0, 4, 6, 7, 8]]
    assert d["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert d["position_ids"].tolist() == [[0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3]]
    assert d["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert d["rollout_log_probs"].dtype == torch.float32
    assert d["rollout_log_probs"].tolist() == [[-1.0, 0.0, 0.0], [-0.5, -0.25, -2.0]]
    assert d["input_ids"].dtype == torch.int64


def test_to_padded_fixed_widths_and_too_long_row():
    t = make_table([[1, 2]], [[3, 4, 5]])
    d = B.to_padded(t, 9, max_prompt_length=4, max_response_length=5)
    assert d["prompts"].tolist() == [[9, 9, 1, 2]]
    assert d["responses"].tolist() == [[3, 4, 5, 9, 9]]
    with pytest.raises(B.BatchError, match="response_ids"):
        B.to_padded(t, 0, max_response_length=2)


def test_to_padded_uses_response_mask_column():
    t = make_table([[1]], [[2, 3, 4]]).append_column(
        "response_mask", pa.array([[1, 0, 1]], pa.list_(pa.int8()))
    )
    d = B.to_padded(t, 0, max_response_length=4)
    assert d["response_mask"].tolist() == [[1, 0, 1, 0]]
    assert d["attention_mask"].tolist() == [[1, 1, 1, 1, 0]]


def test_to_padded_missing_column_names_it():
    t = make_table([[1]], [[2]])
    with pytest.raises(B.BatchError, match="old_log_probs"):
        B.to_padded(t, 0, columns=["old_log_probs"])


def test_sliced_table_is_handled():
    t = make_table([[1, 2], [3], [4, 5, 6]], [[7], [8, 9], []])
    s = t.slice(1, 2)
    d = B.to_padded(s, 0)
    assert d["prompts"].tolist() == [[0, 0, 3], [4, 5, 6]]
    assert d["responses"].tolist() == [[8, 9], [0, 0]]


# ------------------------------------------------------------------ round trips (property tests)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, pad=st.integers(0, 3))
def test_padded_round_trip(rows, pad):
    prompts = [r[0] for r in rows]
    responses = [r[1] for r in rows]
    logps = [[-0.5 * (j + 1) for j in range(len(r))] for r in responses]
    t = make_table(prompts, responses, logps)
    d = B.to_padded(t, pad, columns=["rollout_log_probs"])
    assert B.from_padded(d["responses"], d["response_length"], dtype="int32").to_pylist() == responses
    width = d["prompts"].shape[1]  # prompts are left-padded
    for row, prompt in zip(d["prompts"].tolist(), prompts, strict=True):
        assert row[width - len(prompt) :] == prompt and row[: width - len(prompt)] == [pad] * (
            width - len(prompt)
        )
    back = B.from_padded(d["rollout_log_probs"], d["response_length"])
    assert back.type == LF32
    assert back.to_pylist() == logps
    # the attention mask marks exactly the real tokens
    assert d["attention_mask"].sum().item() == sum(map(len, prompts)) + sum(map(len, responses))
    # positions are consecutive on real tokens
    am = d["attention_mask"].bool()
    for i in range(len(rows)):
        pos = d["position_ids"][i][am[i]].tolist()
        assert pos == list(range(len(pos)))


@settings(max_examples=40, deadline=None)
@given(rows=rows_strategy, k=st.integers(1, 5))
def test_concat_chunk_inverse(rows, k):
    t = make_table([r[0] for r in rows], [r[1] for r in rows])
    parts = B.chunk(t, k)
    assert len(parts) == k
    sizes = [p.num_rows for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert B.concat(parts).equals(t)


def test_add_token_column():
    t = make_table([[1], [2]], [[3, 4], [5]])
    x = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 9.0]])
    t2 = B.add_token_column(t, "old_log_probs", x, "float32")
    assert t2.schema.field("old_log_probs").type == LF32
    assert np.allclose(np.concatenate(t2.column("old_log_probs").to_pylist()), [0.1, 0.2, 0.3])
    t3 = B.add_token_column(t2, "old_log_probs", torch.zeros(2, 2), "float32")  # replace in place
    assert t3.column_names == t2.column_names
    with pytest.raises(B.BatchError, match="old_log_probs"):
        B.add_token_column(t, "old_log_probs", torch.zeros(2, 1))


def test_concat_errors():
    t = make_table([[1], [2], [3]], [[4], [5], [6]])
    with pytest.raises(B.BatchError, match="missing"):
        B.concat([t, t.drop_columns(["uid"])])
    # column order may differ
    assert B.concat([t, t.select(["response_ids", "uid", "prompt_ids"])]).num_rows == 6


def test_repeat_interleave_prompts():
    t = pa.table({"prompt_id": pa.array([10, 11], pa.int64()), "prompt_ids": pa.array([[1], [2, 3]], LI32)})
    counter = iter(["aa", "bb"])
    r = B.repeat_interleave_prompts(t, 3, uid_fn=lambda: next(counter))
    assert r.column("prompt_id").to_pylist() == [10, 10, 10, 11, 11, 11]
    assert r.column("uid").to_pylist() == ["aa"] * 3 + ["bb"] * 3
    assert r.column("sample_idx").to_pylist() == [0, 1, 2, 0, 1, 2]
    assert r.schema.field("sample_idx").type == pa.int32()
    # one uid per sampled prompt, even for duplicated dataset rows (the flows' seeded uid factory)
    dup = pa.table({"prompt_id": pa.array([7, 7], pa.int64())})
    r2 = B.repeat_interleave_prompts(dup, 2, uid_fn=uid_factory(0, "test"))
    uids = r2.column("uid").to_pylist()
    assert uids[0] == uids[1] != uids[2] == uids[3]
    assert all("_" not in u for u in uids)
    with pytest.raises(B.BatchError, match="duplicate"):
        B.repeat_interleave_prompts(dup, 2, uid_fn=lambda: "same")


def test_lengths():
    t = make_table([[1, 2], [3]], [[4], []])
    assert B.response_lengths(t).tolist() == [1, 0]
    assert B.prompt_lengths(t).tolist() == [2, 1]


# ------------------------------------------------------------------ balancing


def _spread(w, parts):
    sums = [int(np.sum(np.asarray(w)[p])) for p in parts]
    return max(sums) - min(sums)


def _greedy_partitions(w, k):
    """Baseline for the tests: largest first, each item to the lightest partition that has room."""
    cap = len(w) // k
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(w)), key=lambda j: (-int(w[j]), j)):
        p = min((q for q in range(k) if len(parts[q]) < cap), key=lambda q: (sums[q], q))
        parts[p].append(i)
        sums[p] += int(w[i])
    return [sorted(p) for p in parts]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), k=st.integers(1, 6), per=st.integers(1, 8))
def test_kk_partitions_equal_size_permutation(data, k, per):
    w = data.draw(st.lists(st.integers(0, 5000), min_size=k * per, max_size=k * per))
    parts = B.balance_partitions(w, k)
    assert len(parts) == k
    assert all(len(p) == per for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(len(w)))
    assert all(p == sorted(p) for p in parts)
    # largest-differencing bound: spread never exceeds the range of single items
    assert _spread(w, parts) <= max(w) - min(w)


def test_kk_beats_greedy_on_random_inputs():
    """KK's spread is ≤ greedy's on the large majority of random inputs and lower on average.

    Per instance it is NOT always ≤ (see test_kk_can_lose_to_greedy), so this checks the aggregate."""
    rng = np.random.default_rng(0)
    wins = 0
    kk_total = gr_total = 0
    trials = 300
    for _ in range(trials):
        k = int(rng.integers(2, 9))
        w = rng.integers(1, 4096, size=k * int(rng.integers(2, 17)))
        a = _spread(w, B.balance_partitions(w, k))
        g = _spread(w, _greedy_partitions(w, k))
        wins += a <= g
        kk_total += a
        gr_total += g
    assert wins >= 0.9 * trials
    assert kk_total < gr_total


def test_kk_can_lose_to_greedy():
    """A documented counterexample: KK is a heuristic, not optimal."""
    w = [3, 1, 3, 4, 9, 2]
    assert B.balance_partitions(w, 2) == [[0, 1, 4], [2, 3, 5]]
    assert _spread(w, B.balance_partitions(w, 2)) == 4
    assert _spread(w, _greedy_partitions(w, 2)) == 2


def test_kk_errors():
    with pytest.raises(B.BatchError, match="dp_size"):
        B.balance_partitions([1, 2, 3], 2)


def test_workload_and_balance_batch_order():
    assert B.calculate_workload([0, 1, 100]).tolist() == [0, 24577, 24576 * 100 + 10000]
    lens = [8, 1, 7, 2, 6, 3, 5, 4]
    perm = B.balance_order(lens, 2)
    assert sorted(perm.tolist()) == list(range(8))
    wl = B.calculate_workload(lens)
    parts = B.balance_partitions(wl, 2)
    for r, part in enumerate(parts):
        block = perm[4 * r : 4 * r + 4].tolist()
        ranked = sorted(part, key=lambda i: wl[i])
        assert block == ranked[0::2] + ranked[1::2][::-1]
    # totals of the two ranks equal here (8+1+5+4 = 7+2+6+3)
    assert sorted(sum(lens[i] for i in p) for p in parts) == [18, 18]
    t = make_table([[1] * n for n in lens], [[]] * 8)
    bt = B.balance_batch(t, 2)
    assert bt.column("uid").to_pylist() == [f"u{i}" for i in perm]
