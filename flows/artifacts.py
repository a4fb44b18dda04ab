"""What a run shows in the Prefect UI: a handful of cards in the flow run's Artifacts tab.

Per training run `<run_id>` (keys are the run id made lowercase, other characters turned into dashes), one
artifact each per flow run, updated in place (a Retry of the flow run updates the same ones):

- `dapo-<run>-progress` — a progress artifact, steps done / total, updated with the table;
- `dapo-<run>-steps` — a table with a row per step, newest first (the run's history from `metrics.jsonl`,
  the last `STEP_TABLE_ROWS`; docs/ARCHITECTURE.md lists the columns); steps shorter than
  `STEP_PUBLISH_INTERVAL_S` share an update (a validated step and the run's end publish at once);
- `dapo-<run>-summary` — markdown, updated after each validation, each automatic restart (a line per restart
  of this flow run) and at the end.

Evaluation (`flows/evaluate.py`) publishes `dapo-eval-<model>` (table) and `dapo-eval-<model>-summary`.
Artifacts are a view: a failure to publish is a warning, never a failed run; outside a flow run nothing is
published. Publishing runs off the step loop, in order, in one background thread in the flow run's context.
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

__all__ = ["STEP_COLUMNS", "RunArtifacts", "artifact_key", "publish_eval", "step_row", "upsert_artifact"]

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
"""Steps finished within this many seconds of the last table update wait and share the next one (with the
progress update); a step with a validation, and the end of the run, publish at once. Each update is an API
call costing server and driver CPU (bench/README.md, "Pinned A/B probes")."""

STEP_TABLE_ROWS = 500
"""The steps table keeps the newest this many rows (every step stays in `metrics.jsonl`)."""

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


def _flow_run_id() -> UUID | None:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return None if ctx is None or ctx.flow_run is None else ctx.flow_run.id


def _in_flow_run() -> bool:
    return _flow_run_id() is not None


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


def _existing(key: str, flow_run_id: UUID) -> UUID | None:
    """The newest artifact `key` that flow run `flow_run_id` created (an earlier attempt of it), or None."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            ),
            sort=ArtifactSort.CREATED_DESC,
            limit=1,
        )
    return found[0].id if found else None


def upsert_artifact(
    kind: str, key: str, data: str | float | list, description: str, known: UUID | None = None
) -> UUID | None:
    """Publish artifact `key` of `kind` ("progress", "table", "markdown") in the current flow run: update the
    one this flow run already has (`known`, else looked up: an earlier attempt's), or create it. Returns its
    id (None outside a flow run). One card per key in the flow run's Artifacts tab, however often called."""
    flow_run_id = _flow_run_id()
    if flow_run_id is None:
        return None
    from prefect import artifacts

    aid = known or _existing(key, flow_run_id)
    if aid is None:
        if kind == "progress" and isinstance(data, float | int):
            made = artifacts.create_progress_artifact(progress=float(data), key=key, description=description)
        elif kind == "table" and isinstance(data, list):
            made = artifacts.create_table_artifact(table=data, key=key, description=description)
        else:
            made = artifacts.create_markdown_artifact(markdown=str(data), key=key, description=description)
        return made  # type: ignore[return-value]
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    payload = json.dumps(data) if kind == "table" else data
    with get_client(sync_client=True) as client:
        client.update_artifact(aid, ArtifactUpdate(data=payload, description=description))
    return aid


class RunArtifacts:
    """Publishes one training run's progress, steps table and summary (a no-op outside a flow run)."""

    def __init__(
        self,
        run_id: str,
        run_dir: Path,
        total_steps: int,
        done_steps: int,
        enabled: bool = True,
        min_interval_s: float = STEP_PUBLISH_INTERVAL_S,
    ) -> None:
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.total = max(int(total_steps), 1)
        self.enabled = enabled and _in_flow_run()
        self.progress_key = artifact_key("dapo", run_id, "progress")
        self.steps_key = artifact_key("dapo", run_id, "steps")
        self.summary_key = artifact_key("dapo", run_id, "summary")
        self.first_val: tuple[int, float] | None = None
        self.last_val: tuple[int, float] | None = None
        self.ids: dict[str, UUID | None] = {}  # artifact key -> id, once created or found
        self.table_updates = 0  # table updates handed to the publisher
        self._publisher: ThreadPoolExecutor | None = None
        self.min_interval_s = float(min_interval_s)
        self.rows: dict[int, dict] = {}  # step -> table row, published and queued
        self.restarts: list[str] = []  # one line per automatic restart of this flow run
        self._last_publish = -math.inf  # time.monotonic() of the last table update handed over
        self._read_history(self.run_dir / "metrics.jsonl", done_steps)
        # rows not handed to the publisher yet: the history read back counts (the earlier attempt may have
        # died before publishing its last steps; the close publishes it when no step is left to train)
        self._pending = bool(self.rows)
        if not self.enabled:
            return
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dapo-artifacts")
        done = int(done_steps)
        self._submit(
            lambda: self._publish("progress", self.progress_key, self._pct_done(done), self._text(done))
        )

    def _pct_done(self, done: int) -> float:
        return round(100.0 * min(done, self.total) / self.total, 2)

    def _text(self, done: int) -> str:
        return f"DAPO run {self.run_id}: {done} / {self.total} train steps"

    def _read_history(self, jsonl: Path, done_steps: int) -> None:
        """Steps and validations logged before this flow run started (a resumed or retried run): the table's
        earlier rows (up to the step it resumes from) and the summary's "before"."""
        if not jsonl.exists():
            return
        for line in jsonl.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                metrics = {k: v for k, v in row.items() if isinstance(v, float)}
                self.validation(row["step"], metrics)
                if 0 < row["step"] <= done_steps:
                    self.rows[row["step"]] = step_row(row["step"], metrics)

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

    def _publish(self, kind: str, key: str, data: str | float | list, description: str) -> None:
        try:
            self.ids[key] = upsert_artifact(kind, key, data, description, known=self.ids.get(key))
        except Exception as exc:
            _warn(key, exc)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        """A step finished: add its table row; publish the table and the progress when `min_interval_s` has
        passed since the last update or the step was validated, and the summary after a validation (published
        in the background; returns at once)."""
        if not self.enabled:
            return
        row = step_row(step, metrics)
        self.rows = {k: v for k, v in self.rows.items() if k < step}  # a replayed step replaces later rows
        self.rows[step] = row
        self._pending = True
        validated = "val_acc" in row
        if validated or time.monotonic() - self._last_publish >= self.min_interval_s:
            self._flush()
        if validated:
            self.validation(step, metrics)
            self.summary(step, final=False)

    def restart(self, step: int, line: str) -> None:
        """The run restarted its workers automatically at `step` (`line` says what failed and from where it
        resumes): a line in the summary, published at once."""
        self.restarts.append(line)
        self.summary(step - 1, final=False)

    def _flush(self) -> None:
        """Hand the table (newest row first) and the progress of its newest step to the publisher."""
        if not self._pending or not self.rows:
            return
        self._pending = False
        self._last_publish = time.monotonic()
        self.table_updates += 1
        rows = [self.rows[k] for k in sorted(self.rows, reverse=True)[:STEP_TABLE_ROWS]]
        last, first = rows[0]["step"], rows[-1]["step"]
        span = f"step {last}" if first == last else f"steps {first}-{last}"
        text = f"DAPO run {self.run_id}, {span}, newest first (every step: metrics.jsonl)"

        def publish() -> None:
            self._publish("progress", self.progress_key, self._pct_done(last), self._text(last))
            self._publish("table", self.steps_key, rows, text)

        self._submit(publish)

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
            *([f"- automatic restarts: {len(self.restarts)}"] if self.restarts else []),
            *(f"  - {line}" for line in self.restarts),
            "",
            _image_markdown(self.run_dir / "curves.png"),
        ]
        markdown = "\n".join(lines)
        self._submit(lambda: self._publish("markdown", self.summary_key, markdown, f"DAPO run {self.run_id}"))
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
        upsert_artifact("table", key, rows, f"evaluation of {model_dir}")
        upsert_artifact(
            "markdown",
            artifact_key(key, "summary"),
            "\n".join(
                [
                    f"# Evaluation of `{model_dir}`",
                    "",
                    f"- held-out accuracy (first `val-core/*/acc/mean@k`): {_pct(acc)}",
                    f"- metrics file: `{output}`",
                    f"- prompts: {int(metrics.get('eval/num_prompts', 0))}, samples each: "
                    f"{int(metrics.get('eval/n', 0))}",
                ]
            ),
            f"evaluation of {model_dir}",
        )
    except Exception as exc:
        _warn(key, exc)
