"""Stage jobs: what a worker needs to read a stage's input from the run store and commit its output itself.

The driver builds a :class:`StageJob` (the run folder, the step and stage names, the input's URI and the
validation limits: a few hundred bytes) and hands it to a worker method; the worker reads the input view
from the store, computes, validates the output against the stage's schema and commits it as a column delta
over its input (:mod:`dapo_core.store.stage_files`). Only the URI and the metrics go back to the driver, so
no table passes through the driver process. A stage whose output is committed already is never handed out
(the driver checks first), and a job that fails commits nothing.

Each worker process keeps one :class:`~dapo_core.store.stage_files.StageFiles` per run folder
(:func:`stage_files`), so a job can find its input in the small view cache when the previous job of the same
worker wrote it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dapo_core.data.schemas import validate_stage
from dapo_core.store.stage_files import StageFiles

__all__ = ["StageJob", "run_job", "stage_files"]

_FILES: dict[str, StageFiles] = {}
_FILES_LOCK = threading.Lock()


def stage_files(root: str) -> StageFiles:
    """This process's :class:`StageFiles` of the run folder ``root`` (opened on first use)."""
    with _FILES_LOCK:
        files = _FILES.get(root)
        if files is None:
            files = _FILES[root] = StageFiles(root)
        return files


@dataclass(frozen=True)
class StageJob:
    """One stage to compute on a worker: read ``input_uri``, compute, validate, commit (step, stage)."""

    root: str
    """The run folder (a path every worker can reach: local, or a shared filesystem mounted alike)."""
    step: int
    stage: str
    """The run-store stage name of the output (e.g. ``old_log_prob``, ``generate_g0``, ``ref_p1``)."""
    input_uri: str
    """The committed stage the worker reads; the output is written as a delta over it."""
    timer: str
    """The metrics key of the stage's time: ``timing_s/<timer>``."""
    schema: str | None = None
    """The stage schema the output is validated against (``dapo_core.data.schemas.STAGES``), or None."""
    n: int | None = None
    vocab_size: int = 0
    max_prompt_length: int = 0
    max_response_length: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    """Extra manifest meta (the metrics are added)."""

    def read(self) -> pa.Table:
        """The input view (checksums verified)."""
        return stage_files(self.root).read_uri(self.input_uri)

    def commit(
        self, table: pa.Table, metrics: dict[str, float], started: float
    ) -> tuple[str, dict[str, float]]:
        """Validate ``table`` and commit it with ``metrics`` (plus ``timing_s/<timer>`` since ``started``, a
        ``time.perf_counter()``); returns the URI and the metrics."""
        if self.schema is not None:
            validate_stage(
                self.schema,
                table,
                n=self.n,
                vocab_size=self.vocab_size,
                max_prompt_length=self.max_prompt_length,
                max_response_length=self.max_response_length,
            )
        metrics = {**metrics, f"timing_s/{self.timer}": time.perf_counter() - started}
        uri = stage_files(self.root).write_stage(
            self.step, self.stage, table, meta={**self.meta, "metrics": metrics}, base=self.input_uri
        )
        return uri, metrics


def run_job(
    job: StageJob, compute: Callable[[pa.Table], tuple[pa.Table, dict[str, float]]]
) -> tuple[str, dict[str, float]]:
    """Read the job's input, ``compute`` the output table and metrics, validate and commit it."""
    started = time.perf_counter()
    out, metrics = compute(job.read())
    return job.commit(out, metrics, started)
