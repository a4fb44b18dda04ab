"""Tests for dapo_core.compute.sft: solutions score correctly, the warm-up lowers the loss and saves an HF
folder, and the warm-up solution mix leaves out the `Answer:` line at the configured rate."""

from __future__ import annotations

import re

import pytest
import torch

from dapo_core.compute.sft import (
    SFTError,
    answer_line_solution,
    carry_slip_solution,
    encode_sft_example,
    synthetic_solution,
    warmup_sft,
)
from dapo_core.data.datasets import make_synthetic_math, tokenize_prompt
from dapo_core.rewards.math_dapo import compute_score
from tests.helpers import tiny_model_cfg

TINY = tiny_model_cfg(max_position_embeddings=128)


@pytest.fixture
def model_dir(tmp_path):
    """A freshly built tiny model folder."""
    from dapo_core.compute.models import build_tiny_model

    return build_tiny_model(tmp_path / "m", TINY, seed=0)


def test_synthetic_solution_format():
    row = make_synthetic_math(1, seed=0)[0]
    expr, gt = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
    assert synthetic_solution(row) == f"{expr}={gt}\nAnswer: {gt}"
    bare = dict(row, extra_info=None)
    assert synthetic_solution(bare) == f"Answer: {gt}"
    with pytest.raises(SFTError, match="ground_truth"):
        synthetic_solution({"prompt": row["prompt"]})


def test_carry_slip_solution_is_deterministic_and_only_wrong_on_carries():
    rows = make_synthetic_math(400, seed=1)
    slipped = 0
    for r in rows:
        s = carry_slip_solution(r, slip_prob=0.6, seed=3)
        assert s == carry_slip_solution(r, slip_prob=0.6, seed=3)
        a, b = map(int, r["extra_info"]["expression"].split("+"))
        no_carry = all((a // 10**k) % 10 + (b // 10**k) % 10 < 10 for k in range(3))
        if s != synthetic_solution(r):
            slipped += 1
            assert not no_carry  # a problem without carries has only one answer
    assert 0.2 < slipped / len(rows) < 0.6
    assert all(carry_slip_solution(r, slip_prob=0.0) == synthetic_solution(r) for r in rows[:20])


def test_encode_sft_example_layout():
    from dapo_core.compute.models import build_char_tokenizer

    tok = build_char_tokenizer()
    row = make_synthetic_math(1, seed=0)[0]
    ids, plen = encode_sft_example(tok, row, "Answer: 5")
    assert ids[:plen] == tokenize_prompt(tok, row["prompt"])
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[plen:-1]) == "Answer: 5"


def test_warmup_sft_lowers_loss_and_saves(model_dir):
    from transformers import AutoModelForCausalLM

    from dapo_core.compute.models import load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer(model_dir)
    before = {
        k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict().items()
    }
    rows = make_synthetic_math(64, max_value=20, seed=0)
    m = warmup_sft(model_dir, rows, tok, steps=40, lr=3e-3, batch_size=16, seed=0)
    assert m["steps"] == 40 and len(m["losses"]) == 40 and m["tokens"] > 0
    assert m["loss_last"] < 0.6 * m["loss_first"]
    after = AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_warmup_sft_deterministic(tmp_path):
    from dapo_core.compute.models import build_tiny_model, load_tokenizer

    torch.set_num_threads(1)
    rows = make_synthetic_math(32, max_value=20, seed=0)
    losses = []
    for name in ("a", "b"):
        d = build_tiny_model(tmp_path / name, TINY, seed=1)
        losses.append(
            warmup_sft(d, rows, load_tokenizer(d), steps=5, lr=1e-3, batch_size=8, seed=2)["losses"]
        )
    assert losses[0] == losses[1]


def test_warmup_sft_argument_errors(model_dir, tmp_path):
    from dapo_core.compute.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    rows = make_synthetic_math(4, seed=0)
    with pytest.raises(SFTError, match="steps"):
        warmup_sft(model_dir, rows, tok, steps=0, lr=1e-3, batch_size=2)
    with pytest.raises(SFTError, match="rows"):
        warmup_sft(model_dir, [], tok, steps=1, lr=1e-3, batch_size=2)
    with pytest.raises(SFTError, match=re.escape("config.json")):
        warmup_sft(tmp_path / "missing", rows, tok, steps=1, lr=1e-3, batch_size=2)


# ----------------------------------------------------------------------------------------------------------
# The warm-up solution mix: some solutions forget the `Answer:` line, which the verifier scores as wrong.


def _row(i: int) -> dict:
    return {"reward_model": {"ground_truth": str(i + 7)}, "extra_info": {"expression": f"{i}+7"}}


def test_share_of_answer_lines_follows_the_probability_and_is_deterministic():
    sols = [answer_line_solution(_row(i), answer_line_prob=0.3, seed=1) for i in range(2000)]
    share = sum("Answer:" in s for s in sols) / len(sols)
    assert 0.27 < share < 0.33
    assert sols == [answer_line_solution(_row(i), answer_line_prob=0.3, seed=1) for i in range(2000)]
    assert sols != [answer_line_solution(_row(i), answer_line_prob=0.3, seed=2) for i in range(2000)]


def test_the_verifier_accepts_only_the_solutions_with_the_answer_line():
    for i in range(50):
        sol = answer_line_solution(_row(i), answer_line_prob=0.5)
        assert compute_score(sol, str(i + 7))["acc"] == ("Answer:" in sol)
        assert sol.startswith(f"{i}+7={i + 7}")
    assert answer_line_solution(_row(3)) == "3+7=10\nAnswer: 10"
