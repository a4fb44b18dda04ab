"""What a run shows in the Prefect UI: a progress bar, a metrics table per step, a markdown summary.

Per training run `<run_id>` (keys are the run id made lowercase, other characters turned into dashes):

- `dapo-<run>-progress` — a progress artifact, steps done / total, updated with each table version (a resumed
  or retried flow run creates a new one at the step it starts from);
- `dapo-<run>-steps` — a table artifact with the step's key metrics (score, accuracy, kept groups, entropy,
  response length, clip fractions, step time, held-out accuracy when validated); a new version with the rows
  of the steps since the previous version, so the artifact's history in the UI is the run's history. Steps
  shorter than `STEP_PUBLISH_INTERVAL_S` share a version (a validated step and the run's end publish at once);
  at the recipe's scale, minutes a step, that is one version per step;
- `dapo-<run>-summary` — markdown after each validation and at the end: held-out accuracy first → now, the
  run id, where the checkpoints, metrics and curves are (the curves image embedded when drawn).

Evaluation (`flows/evaluate.py`) publishes `dapo-eval-<model>` (table) and `dapo-eval-<model>-summary`.

Artifacts are a view: a failure to publish one is logged as a warning and never fails the run (the run store
and `metrics.jsonl` stay the source of truth). Outside a Prefect flow run nothing is published. They are
published off the step loop, in order, by one background thread running in the flow run's context (each is
an API call, ~0.1 s on the loaded 2-core machine); the final summary waits until every earlier one is out.
Publishing coalesces because each call costs the server and the driver CPU (py-spy: ~10 ms of server CPU per
call, plus the driver's HTTP client): at a step a second (the CPU default), on one shared core, that is step
time (bench/README.md, session 9).
"""

from __future__ import annotations

import base64
import contextvars
import json
import math
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from uuid import UUID

__all__ = ["STEP_COLUMNS", "RunArtifacts", "artifact_key", "publish_eval", "step_row"]

STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("score", "critic/score/mean"),
    ("acc", "critic/acc/mean"),
    ("kept_groups", "train/num_kept_groups"),
    ("gen_batches", "train/num_gen_batches"),
    ("entropy", "actor/entropy"),
    ("response_len", "response_length/mean"),
    ("clipfrac", "actor/pg_clipfrac"),
    ("clipfrac_lower", "actor/pg_clipfrac_lower"),
    ("step_s", "timing_s/step"),
)
"""(column, metric key) of the per-step table, in display order; `val_acc` is added when validated."""

STEP_PUBLISH_INTERVAL_S = 5.0
"""Steps finished within this many seconds of the last published table version wait and share the next one
(with the progress update); a step with a validation, and the end of the run, publish at once."""

MAX_EMBEDDED_IMAGE_BYTES = 400_000
"""Curves images up to this size are embedded in the summary (as a data URI); larger ones are linked."""


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key from `parts`: lowercase letters, digits and dashes only (Prefect's rule)."""
    key = "-".join(parts).lower()
    key = re.sub(r"[^a-z0-9-]+", "-", key)
    return re.sub(r"-{2,}", "-", key).strip("-")


def headline(metrics: Mapping[str, float]) -> float | None:
    """The first `val-core/<source>/acc/mean@k` value of `metrics` (sorted by key), or None."""
    vals = [v for k, v in sorted(metrics.items()) if k.startswith("val-core/") and "/acc/mean@" in k]
    return float(vals[0]) if vals else None


def step_row(step: int, metrics: Mapping[str, float]) -> dict[str, float | int | None]:
    """One row of the per-step table: the step, its key metrics (None when absent) and held-out accuracy."""
    row: dict[str, float | int | None] = {"step": step}
    for col, key in STEP_COLUMNS:
        v = metrics.get(key)
        row[col] = None if v is None or not math.isfinite(float(v)) else round(float(v), 4)
    val = headline(metrics)
    if val is not None:
        row["val_acc"] = round(val, 4)
    return row


def _in_flow_run() -> bool:
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def _warn(what: str, exc: BaseException) -> None:
    import logging

    logging.getLogger("dapo.artifacts").warning("could not publish %s to Prefect: %r", what, exc)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def _image_markdown(path: Path) -> str:
    if not path.exists():
        return f"curves: `{path}` (drawn when the run closes)"
    data = path.read_bytes()
    if len(data) > MAX_EMBEDDED_IMAGE_BYTES:
        return f"curves: `{path}`"
    return f"curves: `{path}`\n\n![training curves](data:image/png;base64,{base64.b64encode(data).decode()})"


class RunArtifacts:
    """Publishes one training run's progress, per-step table and summary (a no-op outside a flow run)."""

    def __init__(
        self,
        run_id: str,
        run_dir: Path,
        total_steps: int,
        done_steps: int,
        enabled: bool = True,
        min_interval_s: float = STEP_PUBLISH_INTERVAL_S,
    ):
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.total = max(int(total_steps), 1)
        self.enabled = enabled and _in_flow_run()
        self.progress_key = artifact_key("dapo", run_id, "progress")
        self.steps_key = artifact_key("dapo", run_id, "steps")
        self.summary_key = artifact_key("dapo", run_id, "summary")
        self.first_val: tuple[int, float] | None = None
        self.last_val: tuple[int, float] | None = None
        self._progress_id: UUID | None = None
        self._publisher: ThreadPoolExecutor | None = None
        self.min_interval_s = float(min_interval_s)
        self._pending: list[dict] = []  # rows of finished steps not handed to the publisher yet
        self._last_publish = -math.inf  # time.monotonic() of the last table version handed over
        self._read_history(self.run_dir / "metrics.jsonl")
        if not self.enabled:
            return
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dapo-artifacts")
        try:
            from prefect.artifacts import create_progress_artifact

            self._progress_id = create_progress_artifact(  # type: ignore[assignment]
                progress=self._pct_done(done_steps),
                key=self.progress_key,
                description=self._progress_text(done_steps),
            )
        except Exception as exc:
            _warn(self.progress_key, exc)

    def _pct_done(self, done: int) -> float:
        return round(100.0 * min(done, self.total) / self.total, 2)

    def _progress_text(self, done: int) -> str:
        return f"DAPO run {self.run_id}: {done} / {self.total} train steps"

    def _read_history(self, jsonl: Path) -> None:
        """Validations logged before this flow run started (a resumed or retried run): its "before"."""
        if not jsonl.exists():
            return
        for line in jsonl.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                self.validation(row["step"], {k: v for k, v in row.items() if isinstance(v, float)})

    def validation(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record a validation's held-out accuracy (the first one is the summary's "before")."""
        acc = headline(metrics)
        if acc is None:
            return
        if self.first_val is None or step < self.first_val[0]:
            self.first_val = (step, acc)
        self.last_val = (step, acc)

    def _submit(self, publish: Callable[[], None]) -> None:
        """Publish in the background thread (in order), in the current (flow run) context."""
        if self._publisher is None:
            publish()
            return
        self._publisher.submit(contextvars.copy_context().run, publish)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        """A step finished: queue its table row; publish the rows queued so far (a table version and the
        progress) when `min_interval_s` has passed since the last version or the step was validated, and the
        summary after a validation (published in the background; returns at once)."""
        if not self.enabled:
            return
        row = step_row(step, metrics)
        self._pending.append(row)
        validated = "val_acc" in row
        if validated or time.monotonic() - self._last_publish >= self.min_interval_s:
            self._flush()
        if validated:
            self.validation(step, metrics)
            self.summary(step, final=False)

    def _flush(self) -> None:
        """Hand the queued rows to the publisher as one table version (with the progress of the last)."""
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        self._last_publish = time.monotonic()
        self._submit(lambda: self._publish_steps(rows))

    def _publish_steps(self, rows: list[dict]) -> None:
        from prefect.artifacts import create_table_artifact, update_progress_artifact

        last, first = rows[-1]["step"], rows[0]["step"]
        try:
            if self._progress_id is not None:
                update_progress_artifact(
                    self._progress_id, progress=self._pct_done(last), description=self._progress_text(last)
                )
        except Exception as exc:
            _warn(self.progress_key, exc)
        steps = f"step {last}" if first == last else f"steps {first}-{last}"
        try:
            create_table_artifact(
                table=rows, key=self.steps_key, description=f"DAPO run {self.run_id}, {steps}"
            )
        except Exception as exc:
            _warn(self.steps_key, exc)

    def close(self) -> None:
        """Wait until every artifact handed to the background thread is published, and stop the thread (a
        flow run that fails still shows the steps it finished); later ones are published directly."""
        if self.enabled:
            self._flush()
        if self._publisher is not None:
            self._publisher.shutdown(wait=True)
            self._publisher = None

    def summary(self, step: int, final: bool) -> None:
        """Publish the markdown summary (after a validation, and with `final=True` at the end of the run:
        returns once it and every earlier artifact are published)."""
        if not self.enabled:
            return
        first, last = self.first_val, self.last_val
        change = ""
        if first is not None and last is not None and last[0] != first[0]:
            change = f" ({(last[1] - first[1]) * 100:+.1f} points)"
        acc_line = (
            "held-out accuracy: not validated yet"
            if last is None
            else f"held-out accuracy: step {first[0] if first else '?'} {_pct(first[1] if first else None)}"
            f" → step {last[0]} {_pct(last[1])}{change}"
        )
        ckpt = self.run_dir / "ckpt"
        lines = [
            f"# DAPO run `{self.run_id}` — {'finished' if final else 'in progress'}",
            "",
            f"- train steps: {step} / {self.total}",
            f"- {acc_line}",
            f"- run store: `{self.run_dir}` (stage files, ledger, `metrics.jsonl`, `tensorboard/`)",
            f"- checkpoints: `{ckpt}` (latest: `{ckpt / 'latest'}`)",
            f"- resume: run the deployment with `run_id={self.run_id}`, or press Retry on this flow run",
            "",
            _image_markdown(self.run_dir / "curves.png"),
        ]
        markdown = "\n".join(lines)

        def publish() -> None:
            try:
                from prefect.artifacts import create_markdown_artifact

                create_markdown_artifact(
                    markdown=markdown, key=self.summary_key, description=f"DAPO run {self.run_id}"
                )
            except Exception as exc:
                _warn(self.summary_key, exc)

        self._submit(publish)
        if final:
            self.close()


def publish_eval(model_dir: str, output: str, metrics: Mapping[str, float]) -> None:
    """Publish an evaluation's metrics: a table (one row per metric) and a markdown headline, under keys
    derived from the evaluated model's folder name (`dapo-eval-<model>`, `dapo-eval-<model>-summary`)."""
    if not _in_flow_run():
        return
    path = Path(model_dir)
    name = path.parent.parent.name + "-" + path.parent.name if path.name == "actor" else path.name
    key = artifact_key("dapo", "eval", name)
    rows = [{"metric": k, "value": round(float(v), 6)} for k, v in sorted(metrics.items())]
    acc = headline(metrics)
    try:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        create_table_artifact(table=rows, key=key, description=f"evaluation of {model_dir}")
        create_markdown_artifact(
            markdown="\n".join(
                [
                    f"# Evaluation of `{model_dir}`",
                    "",
                    f"- held-out accuracy (first `val-core/*/acc/mean@k`): {_pct(acc)}",
                    f"- metrics file: `{output}`",
                    f"- prompts: {int(metrics.get('eval/num_prompts', 0))}, samples each: "
                    f"{int(metrics.get('eval/n', 0))}",
                ]
            ),
            key=artifact_key(key, "summary"),
            description=f"evaluation of {model_dir}",
        )
    except Exception as exc:
        _warn(key, exc)
