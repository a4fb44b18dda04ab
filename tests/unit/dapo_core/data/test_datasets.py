"""Tests for dapo_core.data.datasets: synthetic math rows, parquet I/O, DAPO-Math dedup, PromptSampler."""

from __future__ import annotations

import re

import pyarrow as pa
import pytest

from dapo_core.compute.sft import synthetic_solution
from dapo_core.data.datasets import (
    SYNTHETIC_DATA_SOURCE,
    DataError,
    PromptSampler,
    load_dapo_math,
    make_synthetic_math,
    make_synthetic_splits,
    problem_key,
    read_parquet,
    tokenize_prompt,
    write_parquet,
)
from dapo_core.rewards.math_dapo import compute_score


@pytest.fixture(scope="module")
def tokenizer():
    """The project's character tokenizer."""
    from dapo_core.compute.models import build_char_tokenizer

    return build_char_tokenizer()


# ------------------------------------------------------------------ synthetic
def test_synthetic_schema_and_answers():
    rows = make_synthetic_math(50, min_value=0, max_value=20, num_operands=3, ops=("+", "-", "*"), seed=3)
    assert len(rows) == 50
    for i, r in enumerate(rows):
        assert r["data_source"] == SYNTHETIC_DATA_SOURCE
        assert r["ability"] == "MATH"
        assert r["reward_model"]["style"] == "rule"
        assert r["extra_info"] == {"index": i, "split": "train", "expression": r["extra_info"]["expression"]}
        (msg,) = r["prompt"]
        assert msg["role"] == "user" and "Answer:" in msg["content"]
        assert len(msg["content"]) < 40  # short: the tiny model's context is small
        expr = r["extra_info"]["expression"]
        assert re.fullmatch(r"\d+[-+*]\d+[-+*]\d+", expr)
        assert r["reward_model"]["ground_truth"] == str(eval(expr))  # python precedence == ours
    assert len({problem_key(r) for r in rows}) == 50


def test_synthetic_deterministic_and_seed_sensitive():
    a = make_synthetic_math(20, seed=1)
    assert a == make_synthetic_math(20, seed=1)
    assert a != make_synthetic_math(20, seed=2)


def test_splits_disjoint_and_val_independent_of_train_size():
    train, val = make_synthetic_splits(300, 100, seed=0, max_value=30)
    assert not {problem_key(r) for r in train} & {problem_key(r) for r in val}
    assert {r["extra_info"]["split"] for r in val} == {"test"}
    _, val2 = make_synthetic_splits(50, 100, seed=0, max_value=30)
    assert val == val2


def test_synthetic_space_too_small_names_fields():
    with pytest.raises(DataError, match="max_value"):
        make_synthetic_math(200, min_value=0, max_value=9, num_operands=2, ops=("+",))
    with pytest.raises(DataError, match="ops"):
        make_synthetic_math(5, ops=("/",))


def test_math_dapo_scores_synthetic_solution_as_correct():
    rows = make_synthetic_math(30, max_value=99, ops=("+", "-"), seed=4)
    for r in rows:
        sol = synthetic_solution(r)
        assert sol.splitlines()[-1] == f"Answer: {r['reward_model']['ground_truth']}"
        res = compute_score(sol, r["reward_model"]["ground_truth"])
        assert res["acc"] is True and res["score"] == 1.0
        wrong = compute_score(sol.replace("Answer: ", "Answer: 1"), r["reward_model"]["ground_truth"])
        assert wrong["acc"] is False


# ------------------------------------------------------------------ parquet
def test_parquet_round_trip(tmp_path):
    rows = make_synthetic_math(10, seed=0)
    path = write_parquet(rows, tmp_path / "sub" / "train.parquet")
    table = read_parquet(path)
    assert table.num_rows == 10
    assert table.schema.field("prompt").type == pa.list_(
        pa.struct([("content", pa.string()), ("role", pa.string())])
    )
    assert table.to_pylist() == rows


def test_parquet_url_and_missing_column(tmp_path):
    rows = make_synthetic_math(4, seed=0)
    url = f"file://{tmp_path}/x.parquet"
    write_parquet(rows, url)
    assert read_parquet(url).num_rows == 4
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"data_source": ["a"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="prompt"):
        read_parquet(tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="train_files"):
        read_parquet(tmp_path / "nope.parquet")


def test_load_dapo_math_dedup_counts(tmp_path):
    base = make_synthetic_math(7, seed=5)
    train = [dict(r, data_source="math_dapo") for r in base for _ in range(3)]  # each problem 3x
    aime_rows = make_synthetic_math(2, seed=9, exclude=base)
    aime = [
        dict(r, extra_info={"index": k, "split": None}) for k, r in enumerate(aime_rows) for _ in range(4)
    ]
    p1 = write_parquet(train, tmp_path / "dapo.parquet")
    p2 = write_parquet(aime, tmp_path / "aime.parquet")
    table, stats = load_dapo_math([p1, p2], dedup=False)
    assert stats["rows"] == 21 + 8 and table.num_rows == 29
    assert stats["unique"] == 9 and stats["duplicates"] == 20 and stats["max_copies"] == 4
    deduped, stats2 = load_dapo_math([p1, p2], dedup=True)
    assert stats2["rows_out"] == deduped.num_rows == 9
    keys = [problem_key(r) for r in deduped.to_pylist()]
    assert keys == [problem_key(r) for r in base] + [
        problem_key(r) for r in aime_rows
    ]  # first occurrence order
    assert stats2["conflicting_ground_truths"] == 0


def test_load_dapo_math_conflicting_ground_truth(tmp_path):
    r = make_synthetic_math(1, seed=0)[0]
    other = dict(r, reward_model={"ground_truth": "999999", "style": "rule"})
    p = write_parquet([r, other], tmp_path / "c.parquet")
    _, stats = load_dapo_math(p, dedup=True)
    assert stats["conflicting_ground_truths"] == 1 and stats["rows_out"] == 1


# ------------------------------------------------------------------ sampler
def _sampler(tokenizer, n=23, **kw):
    table = pa.Table.from_pylist(make_synthetic_math(n, seed=2))
    kw.setdefault("batch_size", 5)
    kw.setdefault("seed", 7)
    kw.setdefault("max_prompt_length", 128)
    return PromptSampler(table, tokenizer, **kw)


def test_sampler_batch_columns(tokenizer):
    s = _sampler(tokenizer)
    assert len(s) == 4  # 23 // 5, last partial batch dropped
    b = s.next_batch()
    assert b.column_names == ["prompt_id", "data_source", "ground_truth", "prompt_ids"]
    assert b.schema.field("prompt_id").type == pa.int64()
    assert b.schema.field("prompt_ids").type == pa.list_(pa.int32())
    rows = make_synthetic_math(23, seed=2)
    for pid, gt, ids in zip(
        b["prompt_id"].to_pylist(), b["ground_truth"].to_pylist(), b["prompt_ids"].to_pylist(), strict=True
    ):
        assert gt == rows[pid]["reward_model"]["ground_truth"]
        assert ids == tokenize_prompt(tokenizer, rows[pid]["prompt"])
        text = tokenizer.decode(ids)
        assert text.endswith("<|im_start|>assistant\n") and rows[pid]["prompt"][0]["content"] in text


def test_sampler_deterministic_and_epoch_wrap(tokenizer):
    a, b = _sampler(tokenizer), _sampler(tokenizer)
    ids_a = [a.next_batch()["prompt_id"].to_pylist() for _ in range(9)]
    ids_b = [b.next_batch()["prompt_id"].to_pylist() for _ in range(9)]
    assert ids_a == ids_b
    epoch0 = [p for batch in ids_a[:4] for p in batch]
    assert len(set(epoch0)) == 20  # no repeats inside an epoch
    assert ids_a[4:8] != ids_a[:4]  # a new permutation after the wrap
    assert a.epoch == 2  # batches 0-3 epoch 0, 4-7 epoch 1, 8 epoch 2
    assert ids_a != [_sampler(tokenizer, seed=8).next_batch()["prompt_id"].to_pylist() for _ in range(9)]
    seq = _sampler(tokenizer, shuffle=False)
    assert seq.next_batch()["prompt_id"].to_pylist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("taken", [0, 3, 4, 6])
def test_sampler_resume(tokenizer, taken):
    ref = _sampler(tokenizer)
    for _ in range(taken):
        ref.next_batch()
    state = ref.state_dict()
    expected = [ref.next_batch()["prompt_id"].to_pylist() for _ in range(6)]
    fresh = _sampler(tokenizer)
    fresh.load_state_dict(dict(state))
    assert [fresh.next_batch()["prompt_id"].to_pylist() for _ in range(6)] == expected
    with pytest.raises(DataError, match="seed"):
        _sampler(tokenizer, seed=1).load_state_dict(state)


def test_sampler_truncation(tokenizer):
    full = _sampler(tokenizer, max_prompt_length=128).next_batch()["prompt_ids"].to_pylist()
    with pytest.raises(DataError, match="max_prompt_length"):
        _sampler(tokenizer, max_prompt_length=10).next_batch()
    left = _sampler(tokenizer, max_prompt_length=10, truncation="left").next_batch()["prompt_ids"].to_pylist()
    assert left == [ids[-10:] for ids in full]
    with pytest.raises(DataError, match="train_batch_size"):
        _sampler(tokenizer, n=3, batch_size=5)
