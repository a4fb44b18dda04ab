"""A live console display of the run: step k/N, the stage running now, generated tokens and reward."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class StepProgress:
    """rich progress bar over training steps with the stage running and headline metrics (or a no-op)."""

    def __init__(self, run_id: str, enabled: bool = True):
        self.enabled = enabled
        self.run_id = run_id
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._last = ""
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[stage]}"),
                TextColumn("{task.fields[last]}"),
                console=Console(stderr=True),
                transient=False,
                refresh_per_second=4,
            )
            self._progress.start()

    def begin_step(self, step: int, total: int) -> None:
        """A new train step starts."""
        if self._progress is None:
            return
        if self._task is None:
            self._task = self._progress.add_task(
                f"dapo {self.run_id}", total=total, completed=step - 1, stage="", last=""
            )
        self._progress.update(self._task, stage=f"step {step}")

    def stage(self, name: str) -> None:
        """The stage now running."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, stage=name)

    def end_step(self, metrics: dict) -> None:
        """A step finished: advance and show its score, accuracy and generated tokens."""
        if self._progress is None or self._task is None:
            return
        parts = []
        for key, label in (
            ("critic/score/mean", "score"),
            ("critic/acc/mean", "acc"),
            ("perf/gen_tokens", "gen tok"),
            ("train/num_gen_batches", "gen batches"),
        ):
            if key in metrics:
                parts.append(f"{label} {metrics[key]:.3g}")
        val = [v for k, v in metrics.items() if k.startswith("val-core/") and "/acc/mean@" in k]
        if val:
            parts.append(f"val acc {val[0]:.3f}")
        self._progress.update(self._task, advance=1, stage="", last=" | ".join(parts))

    def close(self) -> None:
        """Stop the live display."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def quiet_worker_noise() -> None:
    """Keep the console readable: transformers' and the HF hub's per-process progress bars and info lines
    (one set per Ray worker) are switched off through their environment variables, which the workers
    inherit. `DAPO_WORKER_LOGS=1` leaves them on; a variable the user set is never changed."""
    if os.environ.get("DAPO_WORKER_LOGS") == "1":
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from transformers.utils import logging as hf_logging  # read the variable at import: already done here

        hf_logging.disable_progress_bar()
        if os.environ["TRANSFORMERS_VERBOSITY"] == "error":
            hf_logging.set_verbosity_error()
