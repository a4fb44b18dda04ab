"""The warm-up solution mix: some solutions forget the `Answer:` line, which the verifier scores as wrong."""

from __future__ import annotations

from dapo_core.compute.sft import answer_line_solution
from dapo_core.rewards.math_dapo import compute_score


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
