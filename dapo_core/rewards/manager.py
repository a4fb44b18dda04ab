"""DAPO reward manager: parallel rule-based scoring with per-sample timeouts and overlong reward shaping.

Plays the role of verl's ``DAPORewardManager`` (docs/REFERENCE.md §6.2) on already-decoded rows:
``RewardManager.score(rows)`` returns per-row ``score`` (raw), ``acc``, ``pred``, ``overlong_reward``,
``reward`` (= score + overlong penalty when the overlong buffer is enabled) and ``overlong``. Placing the
reward at the last valid token is the advantage stage's job.

Scoring runs in a small pool of long-lived worker processes (one pipe each); the per-sample timeout is
enforced from the calling thread by polling the pipes (no signals, so ``score`` works from any thread), and
a hung or dead worker is killed and replaced. A timeout or an exception is a counted, logged failure carrying
the row's ``uid``, scored ``failure_score`` (default −1.0), never a silent 0. Batches of at most
``inline_max_rows`` rows (default 0: always the pool) may be scored in a helper thread instead; a hang there
cannot be killed, so after one inline timeout the manager uses only the pool. More in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection, wait
from typing import Any, Self

from dapo_core.errors import DapoUserError
from dapo_core.rewards.scoring import default_compute_score, overlong_penalty

__all__ = ["OverlongBufferConfig", "RewardConfigError", "RewardManager", "RewardResult"]

logger = logging.getLogger(__name__)

ComputeScore = Callable[..., Any]
_REQUIRED_KEYS = ("uid", "data_source", "solution_str", "ground_truth", "valid_response_length")


class RewardConfigError(DapoUserError, ValueError):
    """Invalid reward-manager settings (overlong buffer, workers, timeout)."""


@dataclass
class OverlongBufferConfig:
    """DAPO overlong reward shaping over the last `len` tokens before max_response_length."""

    enable: bool = False
    """Turn the soft overlong penalty on."""
    len: int = 0
    """Buffer length L_cache in tokens (0 < len < max_response_length)."""
    penalty_factor: float = 0.0
    """Penalty at max_response_length (verl's YAML default 0.0; the DAPO scripts set 1.0)."""
    log: bool = False
    """No-op here: `overlong_reward` and `overlong` are always written (verl writes them only when true)."""

    @classmethod
    def coerce(cls, obj: Any) -> OverlongBufferConfig | None:
        """Accept None, an ``OverlongBufferConfig``, a mapping or any object with the four attributes.

        Missing (or null) values take the defaults above, the config's defaults (this class is the
        ``reward_model.overlong_buffer`` section of the config schema).
        """
        if obj is None or isinstance(obj, OverlongBufferConfig):
            return obj
        names = [f.name for f in fields(cls)]
        if isinstance(obj, Mapping):
            unknown = set(obj) - set(names)
            if unknown:
                raise RewardConfigError(
                    f"overlong_buffer has unknown keys {sorted(unknown)}; allowed: {', '.join(names)}"
                )
            values = {k: obj[k] for k in names if obj.get(k) is not None}
        else:
            values = {k: getattr(obj, k) for k in names if getattr(obj, k, None) is not None}
        default = cls()
        return cls(
            enable=bool(values.get("enable", default.enable)),
            len=int(values.get("len", default.len)),
            penalty_factor=float(values.get("penalty_factor", default.penalty_factor)),
            log=bool(values.get("log", default.log)),
        )


@dataclass
class RewardResult:
    """Per-row reward columns (input order) plus failures and metrics of one ``RewardManager.score`` call."""

    score: list[float]
    """Raw score from ``compute_score`` (no overlong penalty); ``failure_score`` for failed rows."""
    acc: list[bool]
    """Correctness flag (``score > 0`` when the scorer returns a bare number)."""
    pred: list[str | None]
    """Extracted prediction (None when unavailable or failed)."""
    overlong_reward: list[float]
    """Overlong penalty (≤ 0; 0.0 when the buffer is disabled)."""
    reward: list[float]
    """score + overlong_reward: the scalar placed at the last valid token."""
    overlong: list[bool]
    """overlong_reward < 0."""
    failures: list[tuple[str, str]] = field(default_factory=list)
    """``(uid, reason)`` for every row that timed out or raised."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``reward/num_failures``, ``reward/num_timeouts``, ``reward/time_s``."""
    extra: dict[str, list[Any]] = field(default_factory=dict)
    """Other keys returned by dict-valued scorers (None where a row lacks the key)."""

    @property
    def num_failures(self) -> int:
        """Number of failed rows."""
        return len(self.failures)


# ----------------------------------------------------------------------------------------------------
# worker process
# ----------------------------------------------------------------------------------------------------


def _worker_main(conn: Connection, compute_score: ComputeScore) -> None:
    """Worker loop: announce readiness, then for each chunk of ``(idx, kwargs)`` send one ``(idx, ok, value)``
    per row as it finishes (so the parent times each row from the previous row's answer, not from
    start-up)."""
    conn.send(("ready", None, None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for idx, kwargs in chunk:
            try:
                msg = (idx, True, compute_score(**kwargs))
            except Exception as exc:
                msg = (idx, False, f"{type(exc).__name__}: {exc}")
            try:
                conn.send(msg)
            except Exception as exc:
                conn.send((idx, False, f"result not picklable: {type(exc).__name__}: {exc}"))


class _Worker:
    __slots__ = ("conn", "inflight", "proc", "served", "started")

    def __init__(self, proc: Any, conn: Connection) -> None:
        self.proc = proc
        self.conn = conn
        self.inflight: deque[tuple[int, dict[str, Any]]] = deque()
        self.started = 0.0
        self.served = 0


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask workers to exit, then kill any that do not; idempotent (used by close and the finaliser)."""
    for w in workers:
        with contextlib.suppress(OSError, ValueError):
            w.conn.send(None)
    for w in workers:
        w.proc.join(timeout=1.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=1.0)
        with contextlib.suppress(OSError):
            w.conn.close()
    workers.clear()


# ----------------------------------------------------------------------------------------------------
# manager
# ----------------------------------------------------------------------------------------------------


class RewardManager:
    """Scores decoded rows in parallel with per-sample timeouts and applies DAPO overlong shaping (§6.2).

    Args:
        compute_score: ``fn(data_source, solution_str, ground_truth, extra_info) -> dict | float``
            (called with keywords). Must be picklable by reference (a module-level function) for the
            process pool.
        max_resp_len: generation cap in tokens; required when the overlong buffer is enabled.
        overlong_buffer: None or an object/mapping with ``enable, len, penalty_factor, log``.
        num_workers: scoring processes (≥ 1).
        timeout_s: per-sample time limit in seconds (> 0).
        failure_score: score given to a row that timed out or raised (default −1.0 = math_dapo's wrong
            answer).
        inline_max_rows: batches with at most this many rows are scored in a helper thread (0 = never).
        chunk_size: rows sent to a worker per message (results still come back one per row).
        start_method: multiprocessing start method for the workers ("spawn" is safe in threaded parents).
        start_timeout_s: how long a new worker may take to import the scorer before ``score`` raises.
    """

    def __init__(
        self,
        compute_score: ComputeScore = default_compute_score,
        *,
        max_resp_len: int | None = None,
        overlong_buffer: Any = None,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        failure_score: float = -1.0,
        inline_max_rows: int = 0,
        chunk_size: int = 16,
        start_method: str = "spawn",
        start_timeout_s: float = 120.0,
    ) -> None:
        self.compute_score = compute_score
        self.overlong_buffer = OverlongBufferConfig.coerce(overlong_buffer)
        buf = self.overlong_buffer
        if buf is not None and buf.enable:
            if max_resp_len is None:
                raise RewardConfigError(
                    "max_resp_len must be provided when overlong_buffer.enable is true; pass "
                    "max_resp_len=data.max_response_length"
                )
            if buf.len <= 0:
                raise RewardConfigError(
                    f"overlong_buffer.len={buf.len} must be > 0 when the buffer is enabled"
                )
            if int(max_resp_len) < buf.len:
                raise RewardConfigError(
                    f"max_resp_len must be larger than overlong_buffer.len (got max_resp_len={max_resp_len}, "
                    f"len={buf.len}); shrink overlong_buffer.len or raise data.max_response_length"
                )
            if not math.isfinite(buf.penalty_factor) or buf.penalty_factor < 0:
                raise RewardConfigError(
                    f"overlong_buffer.penalty_factor={buf.penalty_factor} must be a finite number >= 0"
                )
        if int(num_workers) < 1:
            raise RewardConfigError(f"num_workers={num_workers} must be >= 1 (reward_model.num_workers)")
        if not (float(timeout_s) > 0 and math.isfinite(float(timeout_s))):
            raise RewardConfigError(
                f"timeout_s={timeout_s} must be a finite number > 0 (reward_model.timeout_s)"
            )
        if int(chunk_size) < 1:
            raise RewardConfigError(f"chunk_size={chunk_size} must be >= 1")
        self.max_resp_len = None if max_resp_len is None else int(max_resp_len)
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.failure_score = float(failure_score)
        self.inline_max_rows = int(inline_max_rows)
        self.chunk_size = int(chunk_size)
        self.start_timeout_s = float(start_timeout_s)
        self._ctx: Any = mp.get_context(start_method)  # Spawn/Fork/ForkServerContext by name
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._inline_ok = True
        self._start_up_deaths = 0
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes (a later ``score`` starts new ones)."""
        with self._lock:
            _stop_workers(self._workers)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self.compute_score), daemon=True, name="dapo-reward-worker"
        )
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _await_ready(self, w: _Worker) -> None:
        """Block until the worker has imported everything (start-up time never counts against a row)."""
        reason = None
        try:
            if w.conn.poll(self.start_timeout_s):
                tag, _, _ = w.conn.recv()
                if tag != "ready":
                    reason = f"unexpected first message {tag!r}"
            else:
                reason = f"not ready after {self.start_timeout_s:g} s"
        except (EOFError, OSError):
            w.proc.join(timeout=1.0)
            reason = f"exited during start-up (exit code {w.proc.exitcode})"
        if reason is not None:
            w.proc.kill()
            w.proc.join(timeout=1.0)
            _stop_workers(self._workers)
            raise RuntimeError(
                f"reward scoring process {reason}. With start_method={self._ctx.get_start_method()!r} each "
                "worker imports the calling script and compute_score: guard the script with "
                "`if __name__ == '__main__':` and make compute_score a module-level function; see the "
                "worker's stderr for its traceback"
            )

    def _spawn(self) -> _Worker:
        w = self._start()
        self._await_ready(w)
        return w

    def _check_start_up_deaths(self, w: _Worker) -> None:
        """Refuse to respawn forever when workers die before returning a single row (e.g. a spawned child that
        re-runs an unguarded ``__main__`` script, or a compute_score that cannot be imported)."""
        if w.served:
            self._start_up_deaths = 0
            return
        self._start_up_deaths += 1
        if self._start_up_deaths > self.num_workers + 1:
            self._start_up_deaths = 0
            _stop_workers(self._workers)
            raise RuntimeError(
                "reward scoring processes keep dying before scoring a row (last exit code "
                f"{w.proc.exitcode}). With start_method={self._ctx.get_start_method()!r} each worker "
                "imports the calling script and compute_score: guard the script with "
                "`if __name__ == '__main__':` and make compute_score a module-level function; see the "
                "worker's stderr for its traceback"
            )

    def _kill(self, w: _Worker) -> None:
        w.proc.kill()
        w.proc.join(timeout=2.0)
        with contextlib.suppress(OSError):
            w.conn.close()
        self._workers.remove(w)

    # -- scoring ---------------------------------------------------------------------------------------

    def _run_pool(
        self, tasks: list[tuple[int, dict[str, Any]]], outcomes: dict[int, tuple[str, Any]]
    ) -> None:
        """Score ``tasks`` in the process pool; fill ``outcomes[idx] = ("ok"|"error"|"timeout", value)``."""
        fresh = [self._start() for _ in range(self.num_workers - len(self._workers))]
        self._workers.extend(fresh)
        for w in fresh:
            self._await_ready(w)
        pending = deque(tasks)
        while pending or any(w.inflight for w in self._workers):
            for w in list(self._workers):
                if not w.inflight and pending:
                    size = min(self.chunk_size, max(1, math.ceil(len(pending) / self.num_workers)))
                    chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
                    try:
                        w.conn.send(chunk)
                    except OSError:  # the idle worker died; replace it and retry the rows
                        pending.extendleft(reversed(chunk))
                        self._kill(w)
                        self._workers.append(self._spawn())
                        continue
                    w.inflight.extend(chunk)
                    w.started = time.monotonic()
            busy = [w for w in self._workers if w.inflight]
            deadline = min(w.started for w in busy) + self.timeout_s
            ready = wait([w.conn for w in busy], timeout=max(deadline - time.monotonic(), 0.0))
            dead: list[tuple[_Worker, str]] = []
            for w in busy:
                if w.conn not in ready:
                    continue
                try:
                    while w.inflight and w.conn.poll():
                        idx, ok, value = w.conn.recv()
                        expected, _ = w.inflight.popleft()
                        if idx != expected:  # protocol invariant; never expected
                            raise RuntimeError(f"reward worker returned row {idx}, expected {expected}")
                        outcomes[idx] = ("ok", value) if ok else ("error", value)
                        w.started = time.monotonic()
                        w.served += 1
                except (EOFError, OSError):
                    dead.append((w, f"scoring process died (exit code {w.proc.exitcode})"))
            now = time.monotonic()
            for w in busy:
                if w.inflight and now - w.started > self.timeout_s and all(w is not d for d, _ in dead):
                    dead.append((w, "timeout"))
            for w, reason in dead:
                if reason != "timeout":
                    self._check_start_up_deaths(w)
                idx, _ = w.inflight.popleft()
                kind = "timeout" if reason == "timeout" else "error"
                text = f"timed out after {self.timeout_s:g} s" if kind == "timeout" else reason
                outcomes[idx] = (kind, text)
                pending.extendleft(reversed(w.inflight))
                w.inflight.clear()
                self._kill(w)
                self._workers.append(self._spawn())

    def _run_inline(
        self, tasks: list[tuple[int, dict[str, Any]]], outcomes: dict[int, tuple[str, Any]]
    ) -> list[tuple[int, dict[str, Any]]]:
        """Score in a helper thread with the same per-sample timeout; return the rows left after a hang."""
        results: queue.SimpleQueue[tuple[int, str, Any]] = queue.SimpleQueue()
        stop = threading.Event()
        fn = self.compute_score

        def run() -> None:
            for idx, kwargs in tasks:
                if stop.is_set():
                    return
                try:
                    results.put((idx, "ok", fn(**kwargs)))
                except Exception as exc:
                    results.put((idx, "error", f"{type(exc).__name__}: {exc}"))

        threading.Thread(target=run, daemon=True, name="dapo-reward-inline").start()
        started = time.monotonic()
        for pos, (idx, _) in enumerate(tasks):
            try:
                got_idx, kind, value = results.get(
                    timeout=max(started + self.timeout_s - time.monotonic(), 0.0)
                )
            except queue.Empty:
                stop.set()
                self._inline_ok = False  # the abandoned thread may still be running
                outcomes[idx] = ("timeout", f"timed out after {self.timeout_s:g} s (inline)")
                return tasks[pos + 1 :]
            outcomes[got_idx] = (kind, value)
            started = time.monotonic()
        return []

    def _validate_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for i, row in enumerate(rows):
            missing = [k for k in _REQUIRED_KEYS if k not in row]
            if missing:
                raise KeyError(
                    f"reward row {i} (uid={row.get('uid')!r}) lacks {missing}; each row needs "
                    f"{list(_REQUIRED_KEYS)}"
                )
            n = row["valid_response_length"]
            if isinstance(n, bool) or int(n) != n or int(n) < 0:
                raise ValueError(
                    f"reward row {i} (uid={row['uid']!r}): valid_response_length={n!r} must be an int >= 0"
                )

    def score(self, rows: Sequence[Mapping[str, Any]]) -> RewardResult:
        """Score ``rows`` (dicts with ``uid, data_source, solution_str, ground_truth, valid_response_length``
        and optional ``extra_info``); returns a :class:`RewardResult` in input order. Thread-safe; callable
        from any thread."""
        self._validate_rows(rows)
        t0 = time.perf_counter()
        tasks = [
            (
                i,
                {
                    "data_source": row["data_source"],
                    "solution_str": row["solution_str"],
                    "ground_truth": row["ground_truth"],
                    "extra_info": row.get("extra_info"),
                },
            )
            for i, row in enumerate(rows)
        ]
        outcomes: dict[int, tuple[str, Any]] = {}
        with self._lock:
            if tasks and self._inline_ok and len(tasks) <= self.inline_max_rows:
                tasks = self._run_inline(tasks, outcomes)
            if tasks:
                self._run_pool(tasks, outcomes)
        return self._assemble(rows, outcomes, time.perf_counter() - t0)

    def _assemble(
        self, rows: Sequence[Mapping[str, Any]], outcomes: dict[int, tuple[str, Any]], elapsed: float
    ) -> RewardResult:
        n = len(rows)
        res = RewardResult(score=[], acc=[], pred=[], overlong_reward=[], reward=[], overlong=[])
        extra: dict[str, list[Any]] = {}
        num_timeouts = 0
        buf = self.overlong_buffer
        for i, row in enumerate(rows):
            kind, value = outcomes[i]
            if kind == "ok":
                if isinstance(value, Mapping):
                    if "score" not in value:
                        kind, value = (
                            "error",
                            f"compute_score returned a dict without 'score' (keys {sorted(value)})",
                        )
                    else:
                        score = float(value["score"])
                        acc = bool(value.get("acc", score > 0))
                        pred = value.get("pred")
                        pred = None if pred is None else str(pred)
                        for k, v in value.items():
                            if k not in ("score", "acc", "pred"):
                                extra.setdefault(k, [None] * n)[i] = v
                else:
                    try:
                        score = float(value)
                        acc, pred = score > 0, None
                    except (TypeError, ValueError):
                        kind, value = (
                            "error",
                            f"compute_score returned {type(value).__name__}, not a dict or number",
                        )
            if kind == "ok" and not math.isfinite(score):
                # a NaN/inf score is a broken scorer or ground truth, never a success (acc is dropped too)
                kind, value = "error", f"compute_score returned a non-finite score ({score})"
            if kind != "ok":
                num_timeouts += kind == "timeout"
                res.failures.append((str(row["uid"]), str(value)))
                logger.warning(
                    "reward failure uid=%s data_source=%s: %s", row["uid"], row["data_source"], value
                )
                score, acc, pred = self.failure_score, False, None
            if buf is not None and buf.enable:
                assert self.max_resp_len is not None  # required with the buffer on (checked in __init__)
                over = overlong_penalty(
                    int(row["valid_response_length"]), self.max_resp_len, buf.len, buf.penalty_factor
                )
            else:
                over = 0.0
            res.score.append(score)
            res.acc.append(acc)
            res.pred.append(pred)
            res.overlong_reward.append(over)
            res.reward.append(score + over)
            res.overlong.append(over < 0)
        res.extra = extra
        res.metrics = {
            "reward/num_failures": float(len(res.failures)),
            "reward/num_timeouts": float(num_timeouts),
            "reward/time_s": float(elapsed),
        }
        return res
