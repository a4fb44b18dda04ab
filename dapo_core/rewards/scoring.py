"""Rule-based scoring routed by ``data_source`` and DAPO's overlong reward shaping
(docs/REFERENCE.md §6.2–6.3).

Standard library only (no torch), so scoring processes start quickly.
"""

from __future__ import annotations

import math
from typing import Any

from dapo_core.rewards import math_dapo

MATH_DAPO_SOURCES = frozenset(
    {"math_dapo", "math", "math_dapo_reasoning", "synthetic_arith", "synthetic_word"}
)
"""Data sources scored by :func:`math_dapo.compute_score` (plus any source starting with ``"aime"``)."""


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, Any] | float:
    """Score one response with the scorer for its ``data_source`` (§6.3, NEWEST routing).

    ``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*`` and our synthetic ``synthetic_arith`` go to
    :func:`math_dapo.compute_score` (dict ``{"score", "acc", "pred"}``); dict results are returned as-is,
    numeric ones as ``float``. Unknown sources raise ``NotImplementedError`` naming the source.
    ``extra_info`` is accepted for interface compatibility and unused by the math scorer.
    """
    if has_scorer(data_source):
        result: Any = math_dapo.compute_score(solution_str, ground_truth)
    else:
        raise NotImplementedError(
            f"no reward function for data_source={data_source!r}; supported: {sorted(MATH_DAPO_SOURCES)} and "
            "'aime*'. Fix the data_source column of the dataset or pass a custom compute_score to "
            "RewardManager"
        )
    if isinstance(result, dict):
        return result
    return float(result)


def has_scorer(data_source: str) -> bool:
    """True when :func:`default_compute_score` has a scoring function for ``data_source``."""
    return data_source in MATH_DAPO_SOURCES or str(data_source).startswith("aime")


def ground_truth_problem(data_source: str, ground_truth: Any) -> str | None:
    """Why ``ground_truth`` cannot be scored for ``data_source`` (None when it can): a missing, empty,
    NaN or non-string value, or one whose normalised answer is empty. Used by the preflight data scan so that
    such rows are caught before training instead of failing every reward call."""
    if ground_truth is None:
        return "the ground truth is missing (null)"
    if isinstance(ground_truth, float) and math.isnan(ground_truth):
        return "the ground truth is NaN"
    if not isinstance(ground_truth, str):
        return f"the ground truth is a {type(ground_truth).__name__}, not a string"
    if ground_truth.strip().lower() in ("", "nan", "none", "null"):
        return f"the ground truth is {ground_truth!r} (a missing value written as text)"
    if has_scorer(data_source):
        try:
            normalised = math_dapo.normalize_final_answer(ground_truth)
        except Exception as e:  # the scorer's own parser: any failure here fails every reward call too
            return f"the ground truth {ground_truth[:40]!r} cannot be parsed ({type(e).__name__}: {e})"
        if not normalised:
            return f"the ground truth {ground_truth[:40]!r} normalises to an empty answer"
    return None


def overlong_penalty(
    valid_response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> float:
    """DAPO soft overlong penalty (§6.2; paper's R_length): 0 up to ``max_resp_len − buffer_len`` tokens,
    then falling linearly to ``−penalty_factor`` at ``max_resp_len`` (capped at 0 above, never positive).

    ``valid_response_length`` is the count of generated tokens (incl. EOS). Example with 20480/4096/1.0:
    16384 → 0.0, 18432 → −0.5, 20480 → −1.0.
    """
    if int(buffer_len) <= 0:
        raise ValueError(
            f"overlong_buffer.len={buffer_len} must be > 0 (the tokens over which the penalty ramps)"
        )
    if max_resp_len is None or int(max_resp_len) < int(buffer_len):
        raise ValueError(
            f"max_resp_len={max_resp_len} must be >= overlong_buffer.len={buffer_len}; set "
            "data.max_response_length / reward max_resp_len to the generation cap"
        )
    if int(valid_response_length) < 0:
        raise ValueError(f"valid_response_length={valid_response_length} must be >= 0")
    if not math.isfinite(float(penalty_factor)) or float(penalty_factor) < 0:
        raise ValueError(f"overlong_buffer.penalty_factor={penalty_factor} must be a finite number >= 0")
    expected_len = int(max_resp_len) - int(buffer_len)
    exceed_len = int(valid_response_length) - expected_len
    value = -exceed_len / int(buffer_len) * float(penalty_factor)
    return value if value < 0 else 0.0
