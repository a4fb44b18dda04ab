"""History-aware prompt sampling: skip, with a small exploration probability, prompts whose recent groups had
no reward spread (all correct or all wrong): DAPO's dynamic sampling would most likely filter them again.

`HistorySampler` is a `PromptSampler` of one prompt per batch (what the flow's chunk sampler draws from) that
remembers, per prompt, the outcome of its last `window` groups: 0 all wrong, 1 mixed, 2 all correct
(`observe`). Drawing walks the same seeded epoch order as `PromptSampler`; a prompt whose last `window`
groups all had no spread is passed over unless a coin seeded by (seed, epoch, position) falls under
`explore_prob`. Passed-over prompts stay in the data set: the next epoch offers them again. The history and
the position are the sampler's state (`state_dict`, JSON, checkpointed with the prompt stages), and the coins
are derived from the position, so a resumed run draws exactly what the uninterrupted one drew.
Off by default (`data.history_sampler.enable`); the DAPO reproduction configs keep verl's sampler.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from dapo_core.data.datasets import DataError, PromptSampler

__all__ = ["ALL_CORRECT", "ALL_WRONG", "MIXED", "HistorySampler", "group_outcomes"]

ALL_WRONG, MIXED, ALL_CORRECT = 0, 1, 2
"""Outcome codes of one prompt group."""

_COIN_STREAM = 7919
"""Separates the exploration coins' seed from the epoch permutation's (`default_rng([seed, epoch])`)."""


def group_outcomes(prompt_ids: Iterable[int], accs: Iterable[bool]) -> dict[int, list[int]]:
    """The outcome code of every group in a scored batch (rows of a group share their `prompt_id`).

    Rows of one prompt in one batch count as one group (the flow never draws a prompt twice per batch)."""
    groups: dict[int, list[bool]] = {}
    for pid, acc in zip(prompt_ids, accs, strict=True):
        groups.setdefault(int(pid), []).append(bool(acc))
    out: dict[int, list[int]] = {}
    for pid, vals in groups.items():
        code = ALL_CORRECT if all(vals) else ALL_WRONG if not any(vals) else MIXED
        out.setdefault(pid, []).append(code)
    return out


class HistorySampler(PromptSampler):
    """`PromptSampler` (batch_size 1) that passes over prompts whose recent groups had no reward spread."""

    def __init__(self, table: pa.Table, tokenizer: Any, *, window: int, explore_prob: float, **kwargs: Any):
        """`window`: how many of a prompt's latest groups must all lack spread for it to be passed over;
        `explore_prob`: the chance such a prompt is drawn anyway. Other arguments as `PromptSampler`."""
        if kwargs.get("batch_size", 1) != 1:
            raise DataError("HistorySampler draws one prompt at a time (batch_size=1)")
        if window < 1:
            raise DataError(f"data.history_sampler.window={window} must be >= 1 (groups of a prompt)")
        if not 0.0 <= explore_prob <= 1.0:
            raise DataError(f"data.history_sampler.explore_prob={explore_prob} must be in [0, 1]")
        super().__init__(table, tokenizer, **{**kwargs, "batch_size": 1})
        self.window = int(window)
        self.explore_prob = float(explore_prob)
        self.history: dict[int, list[int]] = {}
        self.drawn = 0
        self.passed_over = 0

    def observe(self, prompt_ids: Iterable[int], accs: Iterable[bool]) -> None:
        """Record the outcome of every group of a scored batch (its `prompt_id` and `acc` columns)."""
        for pid, codes in group_outcomes(prompt_ids, accs).items():
            self.history[pid] = (self.history.get(pid, []) + codes)[-self.window :]

    def skips(self, row: int) -> bool:
        """Whether `row`'s last `window` groups all lacked reward spread."""
        h = self.history.get(row, [])
        return len(h) >= self.window and all(c != MIXED for c in h)

    def _explores(self) -> bool:
        coin = np.random.default_rng([self.seed, _COIN_STREAM, self._epoch, self._position]).random()
        return bool(coin < self.explore_prob)

    def next_rows(self) -> np.ndarray:
        """The next prompt's row that is not passed over (after at most one epoch of passing over, the next
        one); `next_batch` returns its table."""
        for _ in range(len(self)):
            if self._position >= len(self):
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            row = int(self._order[self._position])
            if not self.skips(row) or self._explores():
                break
            self._position += 1
            self.passed_over += 1
        self.drawn += 1
        return super().next_rows()

    def state_dict(self) -> dict[str, Any]:
        """`PromptSampler`'s position plus the history and counters (JSON-serialisable)."""
        return {
            **super().state_dict(),
            "history": {str(k): list(v) for k, v in sorted(self.history.items())},
            "drawn": self.drawn,
            "passed_over": self.passed_over,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s output (a state without history, from a plain sampler, starts empty)."""
        super().load_state_dict(
            {k: v for k, v in state.items() if k not in ("history", "drawn", "passed_over")}
        )
        self.history = {int(k): [int(c) for c in v] for k, v in (state.get("history") or {}).items()}
        self.drawn = int(state.get("drawn", 0))
        self.passed_over = int(state.get("passed_over", 0))
