"""What the `dapo` CLI (and the training flow) do around a run so that bad input gets one paragraph.

- `cli_preflight`: `dapo_core.preflight` for a subcommand, the Prefect API check and (for `train`) the run's
  lease, before any flow starts (no Prefect task, no Ray worker, no write to the run store).
- `check_prefect_api`: with `PREFECT_API_URL` set, the server must answer `/health` within a few seconds.
- `prefect_startup_timeout`: the ephemeral Prefect server's start-up timeout, raised unless the user set one.
- `resolve_eval_checkpoint`: `eval.checkpoint: ""` means the run's latest checkpoint.
- `StopRequested` / `stop_on_signals`: SIGTERM / SIGINT become an exception in the main thread, so the flow
  unwinds through its `finally` blocks and the CLI prints how to resume.
- `report_crash` / `report_error`: one paragraph on stderr, the full traceback in a log file, and `--debug` /
  `DAPO_DEBUG=1` to see it on the console.
- `UserErrorConsoleFilter`: keeps Prefect's traceback of a `DapoUserError` off the console (not off the API).

docs/INTERNALS.md (flows/preflight.py) has the details of each.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from dapo_core.config import DapoConfig
from dapo_core.errors import DapoUserError, find_user_error
from dapo_core.preflight import SKIP_ENV, Phase, PreflightError, model_folder_of, preflight
from dapo_core.store.lease import check_free

__all__ = [
    "PREFECT_STARTUP_TIMEOUT_S",
    "StopRequested",
    "UserErrorConsoleFilter",
    "check_prefect_api",
    "cli_preflight",
    "debug_enabled",
    "prefect_startup_timeout",
    "quiet_user_error_tracebacks",
    "report_crash",
    "report_error",
    "resolve_eval_checkpoint",
    "stop_on_signals",
]

PREFECT_STARTUP_TIMEOUT_S = 120
"""Seconds the ephemeral Prefect server may take to start (Prefect's default 20 s fails on a loaded box)."""

_STARTUP_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def debug_enabled(flag: bool = False) -> bool:
    """`--debug` given or `DAPO_DEBUG=1`: show tracebacks on the console."""
    return flag or os.environ.get("DAPO_DEBUG", "") not in ("", "0", "false")


# --------------------------------------------------------------------------------------------- Prefect
def prefect_startup_timeout() -> int:
    """Set the ephemeral server's start-up timeout (unless the user did) and return it."""
    if _STARTUP_ENV not in os.environ:
        os.environ[_STARTUP_ENV] = str(PREFECT_STARTUP_TIMEOUT_S)
    return int(float(os.environ[_STARTUP_ENV]))


def check_prefect_api(timeout_s: float = 5.0) -> str | None:
    """With `PREFECT_API_URL` set, check that its `/health` answers; return the URL (None when unset).
    Raises `PreflightError` naming the URL and the fix when it does not answer."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if not url:
        return None
    import httpx

    health = url.rstrip("/") + "/health"
    try:
        r = httpx.get(health, timeout=timeout_s)
        r.raise_for_status()
    except (httpx.HTTPError, OSError, ValueError) as e:
        raise PreflightError(
            f"the Prefect API at {url} does not answer ({type(e).__name__}: {str(e).splitlines()[0][:120]})",
            where="environment variable PREFECT_API_URL",
            fix="start the server (`prefect server start --host 127.0.0.1`), correct PREFECT_API_URL, or "
            "unset it to use a temporary local server",
        ) from None
    return url


# ------------------------------------------------------------------------------------------- preflight
def resolve_eval_checkpoint(cfg: DapoConfig) -> str:
    """The checkpoint `dapo eval` evaluates: `eval.checkpoint`, or "" = the run's latest: the run named by
    `trainer.experiment_name`, else the most recently changed run folder of `trainer.runs_dir` with a
    checkpoint. Raises `PreflightError` when there is none."""
    if cfg.eval.checkpoint:
        return cfg.eval.checkpoint
    from dapo_core.store.checkpoint import CheckpointDir

    runs = Path(cfg.trainer.runs_dir)
    if cfg.trainer.experiment_name:
        candidates = [runs / cfg.trainer.experiment_name]
    else:
        folders = [p for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
        candidates = sorted(folders, key=lambda p: p.stat().st_mtime, reverse=True)
    for run in candidates:
        quiet = (
            CheckpointDir(run).resume_step(warn=lambda _: None, repair=False)
            if (run / "ckpt").is_dir()
            else None
        )
        if quiet is not None:  # a lost `latest` pointer counts: evaluate resolves (and warns about) it
            return str(run)
    which = f"run {cfg.trainer.experiment_name}" if cfg.trainer.experiment_name else f"any run of {runs}"
    raise PreflightError(
        f"no checkpoint to evaluate: eval.checkpoint is empty (= the run's latest) and {which} has none",
        where="eval.checkpoint / --checkpoint",
        fix="pass --checkpoint runs/<run_id> (or a step folder, or a model folder), or train first",
    )


def cli_preflight(cfg: DapoConfig, command: str, *, flow_only: bool = False, checkpoint: str = "") -> None:
    """Everything checked before a subcommand starts a flow; raises the first problem (a `DapoUserError`)."""
    phase: Phase = "eval" if command == "eval" else ("train" if flow_only else "pipeline")
    check_prefect_api()
    tr = cfg.trainer
    if command == "train" and tr.experiment_name and tr.lease_wait_s <= 0:  # another live writer: refuse now
        check_free(Path(tr.runs_dir) / tr.experiment_name, tr.lease_timeout_s)
    if command in ("train", "eval"):
        model = None
        if command == "eval" and os.environ.get(SKIP_ENV, "") in ("", "0"):
            model = model_folder_of(checkpoint, key="eval.checkpoint (--checkpoint)")
        step_ckpt = checkpoint if command == "eval" and Path(checkpoint).name.startswith("step_") else ""
        preflight(cfg, phase=phase, checkpoint=step_ckpt, model_path=model)


# --------------------------------------------------------------------------------------------- signals
class StopRequested(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived: unwind the run (a KeyboardInterrupt, so Prefect marks the flow run Crashed
    and `except Exception` blocks do not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the first SIGTERM/SIGINT into `StopRequested` in the main thread; later ones are ignored while the
    run shuts down. `dapo_core.compute.cluster` keeps this handler when it starts Ray."""
    if sys.platform == "win32":  # pragma: no cover
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        del frame
        if received:
            return
        received.append(signum)
        print(
            f"\ndapo: {signal.Signals(signum).name} received — stopping at the next safe point "
            "(committed stages are kept)...",
            file=sys.stderr,
            flush=True,
        )
        raise StopRequested(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------- reporting
class UserErrorConsoleFilter(logging.Filter):
    """Drop console log records that carry a `DapoUserError` traceback (Prefect's "Encountered exception"
    and "Finished in state Failed" records of a failed task or flow): the CLI prints the one paragraph."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or find_user_error(exc) is None


class NoTracebackFormatter(logging.Formatter):
    """Formats a console record with `inner` but without its traceback (the CLI's last paragraph names the
    log file that has it); the record itself is left intact for the other handlers (the Prefect API)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def quiet_user_error_tracebacks(debug: bool = False) -> None:
    """Attach `UserErrorConsoleFilter` to the console handlers of the root and `prefect` loggers (once), and
    unless `debug`, format their records without tracebacks (a failed task's traceback reaches the log file
    through `report_crash`). Importing prefect configures its logging, so the handlers exist afterwards."""
    import prefect.main  # noqa: F401  (runs prefect.logging.configuration.setup_logging)

    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for h in logging.getLogger(name).handlers:
            is_console = isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            if is_console and not any(isinstance(f, UserErrorConsoleFilter) for f in h.filters):
                h.addFilter(UserErrorConsoleFilter())
            if is_console and not debug and not isinstance(h.formatter, NoTracebackFormatter):
                h.setFormatter(NoTracebackFormatter(h.formatter))


def _log_path(command: str, run_dir: Path | None) -> Path:
    """Where the full traceback goes: the run's logs/ folder if the run exists, else a temporary file."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if run_dir is not None and run_dir.is_dir():
        folder = run_dir / "logs"
    else:
        folder = Path(tempfile.gettempdir()) / "dapo-errors"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{command}-{stamp}-{os.getpid()}.log"


def report_crash(exc: BaseException, command: str, *, debug: bool, run_dir: Path | None = None) -> int:
    """Any other failure (a bug, a lost worker, a full disk): one paragraph on stderr — what failed, where
    the full traceback was written, and `--debug` — and exit code 1. With `debug` the traceback too."""
    text = "".join(traceback.format_exception(exc))
    if debug:
        sys.stderr.write(text)
    try:
        path = _log_path(command, run_dir)
        path.write_text(text)
        where = f"the full traceback is in {path}"
    except OSError as e:
        where = f"the traceback could not be written ({e.strerror or e})"
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    print(
        f"dapo {command}: failed with {type(exc).__name__}: {first or '(no message)'}. This is not a problem "
        f"with the input we could name; {where}. Run again with --debug (or DAPO_DEBUG=1) to see it here.",
        file=sys.stderr,
        flush=True,
    )
    return 1


last_user_error: DapoUserError | None = None
"""The last error `report_error` printed (for tests and programs embedding the CLI)."""


def report_error(exc: BaseException, command: str, *, debug: bool, run_dir: Path | None = None) -> int | None:
    """Print a `DapoUserError` found in `exc` as one paragraph (the traceback goes to a log file, and to the
    console with `debug`) and return exit code 2; None when `exc` holds no user error (a bug: re-raise)."""
    global last_user_error
    err = find_user_error(exc)
    if err is None:
        return None
    last_user_error = err
    text = "".join(traceback.format_exception(exc))
    where = ""
    if err is not exc:  # raised inside a worker or a task: keep the whole chain for the curious
        try:
            path = _log_path(command, run_dir)
            path.write_text(text)
            where = f" (full traceback: {path})"
        except OSError:
            pass
    if debug:
        sys.stderr.write(text)
    print(f"dapo {command}: {str(err).strip()}{where}", file=sys.stderr)
    return 2
