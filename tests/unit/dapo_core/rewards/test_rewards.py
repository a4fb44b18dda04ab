"""math_dapo scoring, routing, overlong shaping and the parallel reward manager (docs/REFERENCE.md §6.2-6.3,
§10)."""

import re
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_core.rewards import default_compute_score, overlong_penalty
from dapo_core.rewards.manager import RewardConfigError, RewardManager
from dapo_core.rewards.math_dapo import (
    compute_score,
    last_boxed_only_string,
    normalize_final_answer,
    remove_boxed,
)

# --------------------------------------------------------- scorers used by the pool (module level: picklable)


def half_score(data_source, solution_str, ground_truth, extra_info=None):
    """Always 0.5 (a bare number, like the reference test's custom scorer)."""
    return 0.5


def flaky_score(data_source, solution_str, ground_truth, extra_info=None):
    """Hangs on "HANG", raises on "BOOM", otherwise math_dapo."""
    if solution_str == "HANG":
        time.sleep(300)  # the hang itself: the pool's per-sample timeout must cut it short
    if solution_str == "BOOM":
        raise ValueError("boom")
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)


def _row(uid, text, gt="34", n=3, source="math_dapo"):
    return {
        "uid": uid,
        "data_source": source,
        "solution_str": text,
        "ground_truth": gt,
        "valid_response_length": n,
    }


# -------------------------------------------------------------------------------------------------- math_dapo


@pytest.mark.parametrize(
    ("text", "gt", "score", "pred"),
    [
        ("Let me think...\nAnswer: 34", "34", 1.0, "34"),
        ("Answer: 34.", "34", -1.0, "34."),
        ("I am not sure.", "34", -1.0, "[INVALID]"),
        ("so the result is \\boxed{34}", "34", 1.0, "34"),  # NEWEST boxed fallback
        ("answer: 12\nmore\nANSWER : 1,000", "1000", 1.0, "1000"),  # last match, case-insensitive
        ("Answer: x = 5", "5", 1.0, "5"),
        ("Answer: 5\n" + "z" * 400, "5", -1.0, "[INVALID]"),  # only the last 300 characters count
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ],
)
def test_compute_score_examples(text, gt, score, pred):
    out = compute_score(text, gt)
    assert out == {"score": score, "acc": score > 0, "pred": pred}


def test_strict_box_verify_compares_raw_ground_truth():
    assert compute_score("Answer: 7 \\boxed{34}", "34", strict_box_verify=True)["score"] == 1.0
    # strict box does not normalise: "34 " differs from "34"
    assert compute_score("\\boxed{34 }", "34", strict_box_verify=True) == {
        "score": -1.0,
        "acc": False,
        "pred": "34 ",
    }
    assert compute_score("no box", "34", strict_box_verify=True) == {
        "score": -1.0,
        "acc": False,
        "pred": None,
    }
    with pytest.raises(ValueError, match="pause_tokens_index"):
        compute_score("\\boxed{1}", "1", strict_box_verify=True, pause_tokens_index=[1, 2])
    text = "\\boxed{34}" + "x" * 200
    assert compute_score(text, "34", strict_box_verify=True, pause_tokens_index=[0, 0, 0, 12])["score"] == 1.0


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("x = 5", "5"),
        ("1,000", "1000"),
        ("1,2", "12"),
        ("(1,2)", "(1,2)"),
        ("\\text{34}", "34"),
        ("10 degrees", "10"),
        ("$\\boxed{34}$", "34"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("5^\\circ", "5"),
        ("an apple", "apple"),  # plain substring rules, applied verbatim
        ("a banana split", "banansplit"),  # every "a " goes, even inside words
        ("34.", "34."),
    ],
)
def test_normalize_final_answer(raw, norm):
    assert normalize_final_answer(raw) == norm


def test_boxed_helpers():
    assert last_boxed_only_string("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\boxed{\\frac{1}{2}}"
    assert last_boxed_only_string("\\boxed{unclosed") is None
    assert last_boxed_only_string("nothing") is None
    assert remove_boxed("\\boxed{x{y}}") == "x{y}"
    with pytest.raises(ValueError, match="boxed"):
        remove_boxed("boxed{1}")


@pytest.mark.parametrize(
    "source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime", "synthetic_arith"]
)
def test_routing_to_math_dapo(source):
    assert default_compute_score(source, "Answer: 3", "3") == {"score": 1.0, "acc": True, "pred": "3"}


def test_routing_unknown_source():
    with pytest.raises(NotImplementedError, match="'gsm8k'"):
        default_compute_score("gsm8k", "Answer: 3", "3")


# --------------------------------------------------------------------------------------------------- overlong


@pytest.mark.parametrize(
    ("length", "expected"), [(16384, 0.0), (18432, -0.5), (20480, -1.0), (0, 0.0), (16385, -1 / 4096)]
)
def test_overlong_penalty_examples(length, expected):
    assert overlong_penalty(length, 20480, 4096, 1.0) == pytest.approx(expected)


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match=re.escape("overlong_buffer.len")):
        overlong_penalty(10, 20, 0, 1.0)
    with pytest.raises(ValueError, match="max_resp_len"):
        overlong_penalty(10, 4, 8, 1.0)
    with pytest.raises(ValueError, match="valid_response_length"):
        overlong_penalty(-1, 20, 4, 1.0)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(1, 20, 4, -1.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.integers(0, 64), st.integers(0, 128), st.floats(0, 3))
def test_overlong_penalty_properties(buf, extra, length, factor):
    max_len = buf + extra
    length = min(length, max_len)
    value = overlong_penalty(length, max_len, buf, factor)
    assert -factor - 1e-12 <= value <= 0.0
    if length < max_len:
        assert overlong_penalty(length + 1, max_len, buf, factor) <= value
    if length <= max_len - buf:
        assert value == 0.0


# ---------------------------------------------------------------------------------------------------- manager


def test_manager_construction_checks():
    with pytest.raises(RewardConfigError, match="max_resp_len must be provided"):
        RewardManager(
            half_score, overlong_buffer={"enable": True, "len": 2, "penalty_factor": 1.0, "log": False}
        )
    with pytest.raises(RewardConfigError, match="max_resp_len must be larger"):
        RewardManager(half_score, max_resp_len=1, overlong_buffer={"enable": True, "len": 2})
    with pytest.raises(RewardConfigError, match="len=0 must be > 0"):
        RewardManager(half_score, max_resp_len=4, overlong_buffer={"enable": True, "len": 0})
    with pytest.raises(RewardConfigError, match="unknown keys"):
        RewardManager(half_score, overlong_buffer={"enable": False, "lenght": 2})
    with pytest.raises(RewardConfigError, match="timeout_s"):
        RewardManager(half_score, timeout_s=0)
    # disabled buffer or None needs no max_resp_len
    RewardManager(half_score, overlong_buffer={"enable": False, "len": 2})
    RewardManager(half_score, overlong_buffer=None)


def test_manager_overlong_reference_example_and_columns():
    buf = {"enable": True, "len": 2, "penalty_factor": 1.0, "log": True}
    with RewardManager(half_score, max_resp_len=4, overlong_buffer=buf, num_workers=1) as rm:
        res = rm.score([_row("a", "x", n=4), _row("b", "y", n=2), _row("c", "z", n=3)])
    assert res.score == [0.5, 0.5, 0.5]
    assert res.overlong_reward == [-1.0, 0.0, -0.5]
    assert res.reward == [0.5 - 1.0, 0.5, 0.0]
    assert res.overlong == [True, False, True]
    assert res.acc == [True, True, True] and res.pred == [None, None, None]
    assert res.num_failures == 0 and res.metrics["reward/num_failures"] == 0.0


def test_manager_hang_exception_and_rebuild_from_non_main_thread():
    rows = [
        _row("ok1", "Answer: 34"),
        _row("hang-uid", "HANG"),
        _row("boom-uid", "BOOM"),
        _row("ok2", "Answer: 3"),
    ]
    out: dict = {}

    def call():
        rm = RewardManager(flaky_score, num_workers=2, timeout_s=2.0)
        try:
            t0 = time.monotonic()
            out["first"] = rm.score(rows)
            out["elapsed"] = time.monotonic() - t0
            out["second"] = rm.score([_row("after", "Answer: 34")])
        finally:
            rm.close()

    th = threading.Thread(target=call)
    th.start()
    th.join(timeout=280)
    assert not th.is_alive()
    res = out["first"]
    # killed after 2 s (+ the pool's start-up and a new worker's, slow on a busy machine), not after 300 s
    assert out["elapsed"] < 150.0
    assert dict(res.failures).keys() == {"hang-uid", "boom-uid"}
    assert "timed out" in dict(res.failures)["hang-uid"]
    assert "ValueError: boom" in dict(res.failures)["boom-uid"]
    assert res.score == [1.0, -1.0, -1.0, -1.0] and res.acc == [True, False, False, False]
    assert res.metrics["reward/num_failures"] == 2.0 and res.metrics["reward/num_timeouts"] == 1.0
    assert out["second"].score == [1.0] and out["second"].num_failures == 0


def test_manager_inline_path_times_out_and_falls_back_to_pool():
    rm = RewardManager(flaky_score, num_workers=1, timeout_s=0.5, inline_max_rows=100)
    try:
        res = rm.score([_row("a", "Answer: 34"), _row("h", "HANG"), _row("b", "Answer: 34")])
        assert res.score == [1.0, -1.0, 1.0]
        assert res.failures[0][0] == "h" and res.metrics["reward/num_timeouts"] == 1.0
        assert rm._inline_ok is False  # later batches use the killable pool only
    finally:
        rm.close()


def test_manager_rejects_bad_rows_and_custom_failure_score():
    rm = RewardManager(flaky_score, inline_max_rows=10, failure_score=-2.0)
    with pytest.raises(KeyError, match="valid_response_length"):
        rm.score([{"uid": "a", "data_source": "math", "solution_str": "", "ground_truth": "1"}])
    with pytest.raises(ValueError, match="valid_response_length"):
        rm.score([_row("a", "x", n=-1)])
    res = rm.score([_row("a", "BOOM")])
    assert res.score == [-2.0] and res.reward == [-2.0]
    assert rm.score([]).score == []
