"""Rule-based scoring routed by ``data_source`` and DAPO's overlong reward shaping
(docs/REFERENCE.md §6.2–6.3).

Standard library only (no torch), so scoring processes start quickly.
"""

from __future__ import annotations

import math
from typing import Any

from dapo_core.rewards import math_dapo

MATH_DAPO_SOURCES = frozenset({"math_dapo", "math", "math_dapo_reasoning", "synthetic_arith"})
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
    if data_source in MATH_DAPO_SOURCES or str(data_source).startswith("aime"):
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
