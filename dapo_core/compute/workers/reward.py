"""RewardWorker: decodes responses and scores them with the DAPO reward manager (math_dapo + overlong
shaping).

Adds `score` (raw ±1), `acc`, `pred`, `overlong_reward` and `reward` (score + overlong penalty; the scalar
that the advantage stage places at the last valid token). Failed or timed-out samples are counted and logged
with their uid by the reward manager (never a silent zero); a NaN score is a failure. When more than
`max_failure_rate` of a batch's rows fail, `score` raises `RewardFailureRate` naming the data source and one
example row (an unknown data_source or an unparsable ground truth fails every row: training on that would
learn nothing, and the run would otherwise end "Completed"). `score_stage` reads its input from the run store
and commits its output itself (`StageJob`); `transform_stage` does the same for a table function of the
driver's (the advantage stage), and `validation_stage` scores the held-out generation and computes the
`val-core/…` / `val-aux/…` metrics here, so no batch passes through the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa

from dapo_core.compute.faults import fault_point
from dapo_core.compute.tokenizer import load_tokenizer
from dapo_core.data import batch as B
from dapo_core.errors import DapoUserError
from dapo_core.metrics.validation import validation_summary
from dapo_core.rewards import default_compute_score
from dapo_core.rewards.manager import RewardManager
from dapo_core.store.jobs import StageJob, run_job, stage_files


class RewardFailureRate(DapoUserError, RuntimeError):
    """More than `reward_model.max_failure_rate` of a batch's rewards failed (the message names the data
    source, one example row and the scorer's reason)."""


class RewardWorker:
    """Decode + score a batch. `overlong_buffer` is `reward_model.overlong_buffer` as a dict."""

    def __init__(
        self,
        tokenizer_path: str,
        *,
        max_resp_len: int,
        overlong_buffer: Mapping[str, Any] | None,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        max_failure_rate: float = 0.5,
    ) -> None:
        self.max_failure_rate = max_failure_rate
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.manager = RewardManager(
            default_compute_score,
            max_resp_len=max_resp_len,
            overlong_buffer=dict(overlong_buffer) if overlong_buffer else None,
            num_workers=num_workers,
            timeout_s=timeout_s,
        )

    def decode(self, response_ids: list[list[int]]) -> list[str]:
        """Decode responses without special tokens (EOS is dropped), as the reference manager does."""
        return self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)

    def score(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        """Return the table with reward columns added, and the reward metrics."""
        responses = table.column("response_ids").to_pylist()
        texts = self.decode(responses)
        rows = [
            {
                "uid": f"{u}#{s}",
                "data_source": ds,
                "solution_str": txt,
                "ground_truth": gt,
                "valid_response_length": len(r),
            }
            for u, s, ds, gt, txt, r in zip(
                table.column("uid").to_pylist(),
                table.column("sample_idx").to_pylist(),
                table.column("data_source").to_pylist(),
                table.column("ground_truth").to_pylist(),
                texts,
                responses,
                strict=True,
            )
        ]
        res = self.manager.score(rows)
        self._check_failure_rate(rows, res.failures)
        cols = {
            "score": pa.array(res.score, type=pa.float32()),
            "acc": pa.array([bool(a) for a in res.acc], type=pa.bool_()),
            "pred": pa.array([None if p is None else str(p) for p in res.pred], type=pa.string()),
            "overlong_reward": pa.array(res.overlong_reward, type=pa.float32()),
            "reward": pa.array(res.reward, type=pa.float32()),
        }
        for name, col in cols.items():
            table = B.set_column(table, name, col)
        return table, dict(res.metrics)

    def score_stage(self, job: StageJob) -> tuple[str, dict[str, float]]:
        """`score` the generation at `job.input_uri`, committed by this worker as `job.stage`."""
        fault_point(job.root, job.stage, job.step)
        return run_job(job, self.score)

    def validation_stage(self, job: StageJob) -> tuple[str, dict[str, float]]:
        """`score` the validation generation at `job.input_uri` and commit it as `job.stage`; its metrics
        (what goes back to the driver) are `validation_summary` of the scored rows, not the reward
        metrics."""

        def compute(table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
            scored, _ = self.score(table)
            return scored, validation_summary(scored)

        return run_job(job, compute)

    def transform_stage(
        self, job: StageJob, fn: Callable[[pa.Table], tuple[pa.Table, dict[str, float]]]
    ) -> tuple[str, dict[str, float]]:
        """`fn` (a model-free table function, e.g. the advantage stage) applied to the view at
        `job.input_uri` here, committed by this worker as `job.stage`."""
        return run_job(job, fn)

    def summarize(self, root: str, uri: str, fn: Callable[[pa.Table], Any]) -> Any:
        """`fn` (a model-free summary, e.g. a step's data metrics) of the committed view at `uri` of the run
        folder `root`, read here; only its (small) result goes back to the caller. Commits nothing."""
        return fn(stage_files(root).read_uri(uri))

    def _check_failure_rate(self, rows: list[dict], failures: list[tuple[str, str]]) -> None:
        """Raise `RewardFailureRate` when the share of failed rows exceeds `max_failure_rate`."""
        if not rows or len(failures) / len(rows) <= self.max_failure_rate:
            return
        by_uid = {r["uid"]: r for r in rows}
        uid, reason = failures[0]
        row = by_uid.get(uid, rows[0])
        sources = sorted({str(by_uid[u]["data_source"]) for u, _ in failures if u in by_uid})
        raise RewardFailureRate(
            f"{len(failures)} of {len(rows)} rewards failed ({len(failures) / len(rows):.0%} > "
            f"reward_model.max_failure_rate={self.max_failure_rate}); data source(s) {sources}; example row "
            f"uid={uid} data_source={row['data_source']!r} ground_truth={str(row['ground_truth'])[:60]!r}: "
            f"{reason[:200]}",
            fix="correct the data_source / reward_model.ground_truth columns of the dataset (see the "
            "scorer's reason), or raise reward_model.max_failure_rate (1.0 never stops)",
        )

    def close(self) -> None:
        """Stop the scoring pool."""
        close = getattr(self.manager, "close", None)
        if callable(close):
            close()
