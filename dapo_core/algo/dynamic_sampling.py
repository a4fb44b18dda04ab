"""Dynamic sampling (DAPO's group filtering) and adaptive refill sizing (docs/REFERENCE.md §6.1 steps 7–10).

* :func:`filter_groups` keeps every trajectory of a prompt group whose metric varies (population std > 0) and
  of singleton groups; order is preserved. Groups are identified by ``uid`` (one per sampled prompt).
* :func:`next_gen_batch_size` / :class:`KeepRateEstimator` are our addition: instead of always generating a
  fixed ``gen_batch_size`` prompts per refill (the reference), ask for about as many prompts as the running
  keep rate says are needed to fill the deficit, so fewer kept groups are generated only to be discarded as
  surplus. With ``keep_rate=None`` the first batch uses ``base`` (= the configured ``gen_batch_size``), which
  is the reference behaviour.
* :func:`surplus_bounded_size` sizes a batch by its expected surplus instead: the largest batch whose
  expected number of kept groups beyond the deficit (each prompt kept independently with the keep rate, so
  kept ~ Binomial) stays within a budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "KeepRateEstimator",
    "expected_surplus",
    "filter_groups",
    "next_gen_batch_size",
    "surplus_bounded_size",
]


def _group_arrays(
    uids: Sequence[Any] | np.ndarray, values: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    uid_arr = np.asarray(uids)
    val_arr = np.asarray(values, dtype=np.float64)
    if uid_arr.ndim != 1 or val_arr.ndim != 1:
        raise ValueError(
            f"uids and values must be 1-D (one entry per trajectory), got shapes {uid_arr.shape} and "
            f"{val_arr.shape}"
        )
    if uid_arr.shape[0] != val_arr.shape[0]:
        raise ValueError(
            f"uids has {uid_arr.shape[0]} entries but values has {val_arr.shape[0]}; pass one metric value "
            "per trajectory (the filter_groups.metric column of the same rows)"
        )
    return uid_arr, val_arr


def _group_keep(uid_arr: np.ndarray, val_arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-group keep flags and the row→group index (groups in np.unique order)."""
    _, inverse, counts = np.unique(uid_arr, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    ordered = val_arr[order]
    ends = starts + counts
    # np.std per group, exactly as the reference (population std; NaN > 0 is False, so a NaN group is dropped)
    std = np.array([np.std(ordered[a:b]) for a, b in zip(starts, ends, strict=True)], dtype=np.float64)
    keep = (std > 0) | (counts == 1)
    return keep, inverse


def filter_groups(uids: Sequence[Any] | np.ndarray, values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Row mask of dynamic sampling: ``True`` for every row of a kept group, order preserved.

    A group (same ``uid``) is kept iff ``np.std(values) > 0`` (population std) or it has exactly one row
    (§6.1 step 8, §11 trap 1), computed with ``np.std`` per group so the decision is the reference's to the
    bit — including its quirk that identical values such as ``[0.1, 0.1, 0.1]`` can have a std of ~1e-17 and
    be kept. Bools (``acc``) and floats are accepted. A group containing NaN is dropped (unless it is a
    singleton).
    """
    uid_arr, val_arr = _group_arrays(uids, values)
    if uid_arr.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    keep, inverse = _group_keep(uid_arr, val_arr)
    return keep[inverse]


def next_gen_batch_size(
    deficit_groups: int,
    keep_rate: float | None,
    *,
    base: int,
    min_size: int = 1,
    max_size: int | None = None,
    safety: float = 1.2,
    keep_rate_floor: float = 0.05,
) -> int:
    """Prompts to generate next so that about ``deficit_groups`` more groups survive filtering.

    ``keep_rate=None`` (nothing observed yet) → ``base`` (the configured ``gen_batch_size``; clamped to
    ``max_size``). Otherwise ``ceil(deficit / max(keep_rate, keep_rate_floor) · safety)`` clamped to
    ``[min_size, max_size]``. ``deficit_groups <= 0`` → 0 (the batch is full). The floor keeps a batch of
    hopeless prompts from asking for an unbounded number; ``safety`` > 1 trades a little surplus for fewer
    extra rounds.
    """
    if isinstance(deficit_groups, bool) or int(deficit_groups) != deficit_groups:
        raise ValueError(f"deficit_groups={deficit_groups!r} must be an int (groups still needed)")
    if int(base) < 1:
        raise ValueError(f"base={base} must be >= 1 (data.gen_batch_size)")
    if int(min_size) < 1:
        raise ValueError(f"min_size={min_size} must be >= 1")
    if max_size is not None and int(max_size) < int(min_size):
        raise ValueError(f"max_size={max_size} must be >= min_size={min_size}")
    if not (math.isfinite(safety) and safety > 0):
        raise ValueError(f"safety={safety} must be a finite number > 0 (e.g. 1.2)")
    if not (0 < keep_rate_floor <= 1):
        raise ValueError(f"keep_rate_floor={keep_rate_floor} must be in (0, 1]")
    if deficit_groups <= 0:
        return 0
    if keep_rate is None:
        size = int(base)
    else:
        if not (0.0 <= float(keep_rate) <= 1.0):
            raise ValueError(
                f"keep_rate={keep_rate} must be in [0, 1] (kept groups / generated groups) or None"
            )
        size = math.ceil(int(deficit_groups) / max(float(keep_rate), keep_rate_floor) * safety)
    size = max(size, int(min_size))
    if max_size is not None:
        size = min(size, int(max_size))
    return size


def expected_surplus(size: int, keep_rate: float, deficit: int) -> float:
    """E[max(0, K − deficit)] for K ~ Binomial(size, keep_rate): the kept groups a batch of `size` prompts is
    expected to produce beyond `deficit` (they are thrown away as surplus)."""
    if size <= deficit or keep_rate <= 0:
        return 0.0
    if keep_rate >= 1:
        return float(size - deficit)
    k = np.arange(deficit + 1, size + 1)
    log_pmf = (
        math.lgamma(size + 1)
        - np.array([math.lgamma(x + 1) + math.lgamma(size - x + 1) for x in k])
        + k * math.log(keep_rate)
        + (size - k) * math.log1p(-keep_rate)
    )
    return float(np.sum((k - deficit) * np.exp(log_pmf)))


def surplus_bounded_size(
    deficit_groups: int,
    keep_rate: float | None,
    *,
    surplus_budget: float,
    base: int,
    keep_rate_floor: float = 0.05,
    max_size: int | None = None,
) -> int:
    """Prompts to generate next: the largest batch whose expected surplus (`expected_surplus`) is at most
    `surplus_budget` groups, never fewer than `deficit_groups` (a batch that size cannot overshoot).

    ``keep_rate=None`` → ``base``; ``deficit_groups <= 0`` → 0. The keep rate is floored at
    ``keep_rate_floor`` and the size searched up to ``2·deficit/floor`` (clamped to ``max_size``). A small
    budget gives little surplus and more, smaller rounds; the largest size is where the expected surplus of
    one more prompt would cross the budget.
    """
    if isinstance(deficit_groups, bool) or int(deficit_groups) != deficit_groups:
        raise ValueError(f"deficit_groups={deficit_groups!r} must be an int (groups still needed)")
    if int(base) < 1:
        raise ValueError(f"base={base} must be >= 1 (data.gen_batch_size)")
    if not (math.isfinite(surplus_budget) and surplus_budget >= 0):
        raise ValueError(f"surplus_budget={surplus_budget} must be a finite number >= 0 (groups)")
    if deficit_groups <= 0:
        return 0
    if keep_rate is None:
        return int(base) if max_size is None else min(int(base), int(max_size))
    if not 0.0 <= float(keep_rate) <= 1.0:
        raise ValueError(f"keep_rate={keep_rate} must be in [0, 1] (kept groups / generated groups) or None")
    p = max(float(keep_rate), keep_rate_floor)
    lo = int(deficit_groups)  # expected surplus 0
    hi = max(lo, math.ceil(2 * deficit_groups / p) + 1)
    if max_size is not None:
        hi = min(hi, int(max_size))
        lo = min(lo, hi)
    while lo < hi:  # expected_surplus grows with the size: the largest size within the budget
        mid = (lo + hi + 1) // 2
        if expected_surplus(mid, p, int(deficit_groups)) <= surplus_budget:
            lo = mid
        else:
            hi = mid - 1
    return max(lo, 1)


class KeepRateEstimator:
    """Running estimate of the fraction of prompt groups that survive filtering, with a prior.

    ``rate = (kept + prior_rate·prior_weight) / (seen + prior_weight)`` where ``kept``/``seen`` are
    exponentially decayed counts (``decay`` per :meth:`update`; 1.0 = plain running totals), so the estimate
    follows the keep rate as the policy improves. ``rate`` is ``None`` until the first update when
    ``prior_weight == 0``.
    """

    def __init__(self, prior_rate: float = 0.5, prior_weight: float = 0.0, decay: float = 0.9) -> None:
        if not 0.0 <= prior_rate <= 1.0:
            raise ValueError(f"prior_rate={prior_rate} must be in [0, 1]")
        if prior_weight < 0:
            raise ValueError(f"prior_weight={prior_weight} must be >= 0 (pseudo-groups of prior evidence)")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay={decay} must be in (0, 1]")
        self.prior_rate = float(prior_rate)
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        self.kept = 0.0
        self.seen = 0.0

    def update(self, num_kept_groups: int, num_groups: int) -> None:
        """Record one filtered generation batch."""
        if num_groups < 0 or num_kept_groups < 0 or num_kept_groups > num_groups:
            raise ValueError(f"need 0 <= num_kept_groups ({num_kept_groups}) <= num_groups ({num_groups})")
        self.kept = self.kept * self.decay + num_kept_groups
        self.seen = self.seen * self.decay + num_groups

    @property
    def rate(self) -> float | None:
        """Current keep-rate estimate, or None with no evidence and no prior weight."""
        den = self.seen + self.prior_weight
        if den <= 0:
            return None
        return (self.kept + self.prior_rate * self.prior_weight) / den

    def state_dict(self) -> dict[str, float]:
        """Serialisable state (for checkpoints)."""
        return {"kept": self.kept, "seen": self.seen}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.kept = float(state["kept"])
        self.seen = float(state["seen"])
