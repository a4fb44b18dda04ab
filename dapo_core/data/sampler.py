"""History-aware prompt sampling: skip, with a small exploration probability, prompts whose recent groups had
no reward spread (all correct or all wrong): DAPO's dynamic sampling would most likely filter them again.

`HistorySampler` is a `PromptSampler` of one prompt per batch that remembers, per prompt, the outcome of its
last `window` groups: 0 all wrong, 1 mixed, 2 all correct (`observe`). Drawing walks the same seeded epoch
order as `PromptSampler`; a prompt whose last `window` groups all had no spread is passed over unless a coin
seeded by (seed, epoch, position) falls under `explore_prob`; the next epoch offers it again. The history
(one int8 array, row × window, -1 where a prompt has fewer groups; in the state one string of `window`
characters of `-012` per row) and the position are the sampler's state (`state_dict`, JSON, in every prompt
stage's manifest), so a resumed run draws exactly what the uninterrupted one drew.

Off in the schema and the DAPO reproduction configs (verl's sampler); on in the CPU default
(`configs/tiny_cpu.yaml`; bench/README.md, "Against TRL"). Sync step order only: the replay order ignores the
switch (`flows.run_inputs.train_sampler`). docs/ARCHITECTURE.md explains the compact state.
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

_NO_GROUP = -1
"""History slot of a prompt that has had fewer than `window` groups."""

_CODE_CHARS = b"-012"
"""State string characters of the codes _NO_GROUP, ALL_WRONG, MIXED, ALL_CORRECT (code + 1 indexes it)."""

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

    def __init__(
        self, table: pa.Table, tokenizer: Any, *, window: int, explore_prob: float, **kwargs: Any
    ) -> None:
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
        self.history = np.full((len(self), self.window), _NO_GROUP, dtype=np.int8)
        """Per row, the codes of its latest `window` groups, oldest first (`_NO_GROUP` where it had fewer)."""
        self.drawn = 0
        self.passed_over = 0

    def observe(self, prompt_ids: Iterable[int], accs: Iterable[bool]) -> None:
        """Record the outcome of every group of a scored batch (its `prompt_id` and `acc` columns)."""
        for pid, codes in group_outcomes(prompt_ids, accs).items():
            self._check_row(pid)
            row = self.history[pid]
            for code in codes:
                row[:-1] = row[1:].copy()
                row[-1] = code

    def skips(self, row: int) -> bool:
        """Whether `row`'s last `window` groups all lacked reward spread."""
        h = self.history[row]
        return bool(h[0] != _NO_GROUP and not (h == MIXED).any())

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
        """`PromptSampler`'s position plus the history (a string, `window` characters per row) and counters
        (JSON-serialisable)."""
        lut = np.frombuffer(_CODE_CHARS, dtype=np.uint8)
        return {
            **super().state_dict(),
            "history": lut[self.history.ravel() + 1].tobytes().decode("ascii"),
            "drawn": self.drawn,
            "passed_over": self.passed_over,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s output. A state without history (from a plain sampler) starts empty; a
        history saved as a dict of code lists per prompt is read too."""
        super().load_state_dict(
            {k: v for k, v in state.items() if k not in ("history", "drawn", "passed_over")}
        )
        self.history = self._parse_history(state.get("history"))
        self.drawn = int(state.get("drawn", 0))
        self.passed_over = int(state.get("passed_over", 0))

    def _parse_history(self, saved: str | dict[str, list[int]] | None) -> np.ndarray:
        rows, window = len(self), self.window
        history = np.full((rows, window), _NO_GROUP, dtype=np.int8)
        if isinstance(saved, dict):  # {"<row>": [codes, oldest first]}
            for key, codes in saved.items():
                self._check_row(int(key))
                tail = [int(c) for c in codes][-window:]
                history[int(key), window - len(tail) :] = tail
            return history
        if not saved:
            return history
        lookup = np.full(256, -2, dtype=np.int8)
        lookup[np.frombuffer(_CODE_CHARS, dtype=np.uint8)] = np.arange(-1, len(_CODE_CHARS) - 1)
        parsed = lookup[np.frombuffer(saved.encode("ascii", "replace"), dtype=np.uint8)]
        if rows == 0 or parsed.size == 0 or parsed.size % rows or (parsed == -2).any():
            raise DataError(
                f"history sampler: the saved history ({len(saved)} characters) is not a whole number of "
                f"characters in '-012' for each of the {rows} training prompts; resume with the training "
                "data the run started with (data.train_files), or start a new run (trainer.experiment_name)"
            )
        # a window changed since the save keeps each prompt's latest min(old, new) codes, as for the dict form
        saved_rows = parsed.reshape(rows, parsed.size // rows)
        keep = min(window, saved_rows.shape[1])
        history[:, window - keep :] = saved_rows[:, saved_rows.shape[1] - keep :]
        return history

    def _check_row(self, pid: int) -> None:
        if not 0 <= pid < len(self):
            raise DataError(
                f"history sampler: prompt_id {pid} is not a row of the {len(self)}-prompt training table; "
                "the history does not come from this run's data.train_files"
            )
