"""Generated word problems: verl rows, 1-3 operations, integer answers, disjoint splits, math_dapo scores."""

from __future__ import annotations

import re

import pytest

from dapo_core.data.dataset_checks import validate_dataset
from dapo_core.data.datasets import DataError, read_parquet, write_parquet
from dapo_core.data.word_problems import (
    WORD_DATA_SOURCE,
    WORD_EXAMPLES,
    make_word_problem_splits,
    make_word_problems,
    word_prompt,
)
from dapo_core.rewards.scoring import default_compute_score


def _eval(expr: str) -> int:
    assert re.fullmatch(r"[\d()+\-*/]+", expr)
    value = eval(expr.replace("/", "//"))  # our own generated arithmetic, digits and operators only
    return int(value)


def test_rows_answers_and_operations():
    rows = make_word_problems(300, seed=3, max_value=20)
    assert {r["extra_info"]["num_ops"] for r in rows} == {1, 2, 3}
    for r in rows:
        expr, gt = r["extra_info"]["expression"], int(r["reward_model"]["ground_truth"])
        assert _eval(expr) == gt >= 0
        assert expr.count("(") == r["extra_info"]["num_ops"]
        assert r["data_source"] == WORD_DATA_SOURCE
        assert r["prompt"] == word_prompt(r["prompt"][-1]["content"].removeprefix("Question: "))
        assert r["prompt"][-1]["content"].rstrip().endswith("have now?")
    assert rows == make_word_problems(300, seed=3, max_value=20)


def test_splits_are_disjoint_and_valid_parquet(tmp_path):
    train, val = make_word_problem_splits(400, 50, seed=0, num_operands=4, max_value=20)
    assert not {r["prompt"][-1]["content"] for r in train} & {r["prompt"][-1]["content"] for r in val}
    validate_dataset(read_parquet(write_parquet(train, tmp_path / "t.parquet")), name="t")


def test_the_verifier_scores_the_answer_line_and_refuses_bad_options():
    row = make_word_problems(1, seed=1)[0]
    gt = row["reward_model"]["ground_truth"]
    ok = default_compute_score(WORD_DATA_SOURCE, f"3 + 4 = 7.\nAnswer: {gt}", gt)
    bad = default_compute_score(WORD_DATA_SOURCE, f"The answer is {gt}.", gt)
    assert ok["acc"] and not bad["acc"]
    with pytest.raises(DataError, match="max_ops"):
        make_word_problems(3, max_ops=4)
    with pytest.raises(DataError, match="ops="):
        make_word_problems(3, ops=["^"])


def test_the_prompt_is_a_chat_of_worked_examples_that_the_verifier_scores():
    msgs = word_prompt("Mia has 2 apples. She buys 3 more apples. How many apples does Mia have now?")
    assert [m["role"] for m in msgs] == ["user", "assistant"] * len(WORD_EXAMPLES) + ["user"]
    for (q, a), user, assistant in zip(WORD_EXAMPLES, msgs[0::2], msgs[1::2], strict=False):
        assert user["content"].endswith(f"Question: {q}") and assistant["content"] == a
        m = re.search(r"Answer: (\d+)$", a)
        assert m and default_compute_score(WORD_DATA_SOURCE, a, m.group(1))["acc"]
    assert msgs[0]["content"].startswith("Solve the problem.")
    assert msgs[-1]["content"].startswith("Question: ")
