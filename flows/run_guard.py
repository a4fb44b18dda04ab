"""The guard around each `dapo` command and training flow: bad input and every ending get one paragraph.

- `cli_preflight`: `dapo_core.preflight` for a subcommand, the Prefect API check and (for `train`) the run's
  lease, before any flow starts (no Prefect task, no Ray worker, no write to the run store).
- `check_prefect_api`: with `PREFECT_API_URL` set, the server must answer `/health` within a few seconds.
- `prefect_startup_timeout`: the ephemeral Prefect server's start-up timeout, raised unless the user set one.
- `resolve_eval_checkpoint`: `eval.checkpoint: ""` means the run's latest checkpoint.
- `stop_on_signals`: SIGTERM / SIGINT become `dapo_core.errors.StopRequested` in the main thread, so the flow
  unwinds through its `finally` blocks and the CLI prints how to resume.
- `report_crash` / `report_error` / `report_stop`: one paragraph on stderr (the traceback in a log file);
  `run_reported`, `train_checks`: shared by `dapo train` and `python -m flows.pipeline dvc-train`.
- `UserErrorConsoleFilter`: keeps Prefect's traceback of a `DapoUserError` off the console (not off the API).

docs/ARCHITECTURE.md (Preflight) has the details.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from dapo_core.config import ConfigWarning, DapoConfig, load_config
from dapo_core.errors import EXIT_USER_ERROR, DapoUserError, StopRequested, find_user_error
from dapo_core.preflight import (
    SKIP_ENV,
    Phase,
    PreflightError,
    check_cpu_memory,
    model_folder_of,
    preflight,
)
from dapo_core.store.lease import LeaseLost, check_free, forget_lost, lost_lease

__all__ = [
    "PREFECT_STARTUP_TIMEOUT_S",
    "UserErrorConsoleFilter",
    "check_prefect_api",
    "cli_preflight",
    "debug_enabled",
    "load_config_reported",
    "prefect_startup_timeout",
    "quiet_user_error_tracebacks",
    "report_crash",
    "report_error",
    "report_stop",
    "resolve_eval_checkpoint",
    "run_reported",
    "stop_on_signals",
    "train_checks",
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
        preflight(
            cfg,
            phase=phase,
            checkpoint=step_ckpt,
            model_path=model,
            note=lambda text: print(f"dapo {command}: {text}", file=sys.stderr, flush=True),
        )


def load_config_reported(config: str, overrides: Sequence[str], command: str) -> Any:
    """`load_config(config, overrides)`; its `ConfigWarning`s printed as `dapo <command>: warning: ...` lines
    (other warnings as Python shows them). Raises `ConfigError` (a `DapoUserError`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        cfg = load_config(config, list(overrides))
    for w in caught:
        if issubclass(w.category, ConfigWarning):
            print(f"dapo {command}: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return cfg


def train_checks(
    cfg: DapoConfig,
    *,
    flow_only: bool,
    gpu_mem: str | None = None,
    model_config: str | None = None,
    host_mem: str | None = None,
) -> int:
    """What a training run checks before any flow or Prefect server starts: on CPU the memory it needs (one
    paragraph with the changes that fit), the memory plan (printed; 2 when it does not fit, with the fixes),
    then `cli_preflight` (data, model, checkpoint, store, disk, the Prefect API, and the run's lease when
    `trainer.experiment_name` is set). Returns 0 to go on, else the exit code; raises what the checks find
    as a `DapoUserError`."""
    from dapo_core.compute.plan import run_plan

    check_cpu_memory(cfg, model_config)
    code = run_plan(cfg, "train", gpu_mem=gpu_mem, model_config=model_config, dp=1, host_mem=host_mem)
    if code:
        return code
    cli_preflight(cfg, "train", flow_only=flow_only)
    return 0


# --------------------------------------------------------------------------------------------- signals
@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn the first SIGTERM/SIGINT into `StopRequested` in the main thread; later ones are ignored while the
    run shuts down. `dapo_core.compute.cluster` keeps this handler when it starts Ray."""
    if sys.platform == "win32":  # pragma: no cover
        yield
        return
    received: list[int] = []
    forget_lost()

    def handler(signum: int, frame: FrameType | None) -> None:
        del frame
        if received:
            return
        received.append(signum)
        lost = lost_lease()
        if lost is not None and signum == signal.SIGINT:  # the training flow's own interrupt: lease taken
            raise lost
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


def report_stop(stop: KeyboardInterrupt, command: str, *, resume: str = "") -> int:
    """The end of a run stopped by SIGTERM/SIGINT: what was kept and `resume` (a command), exit 128 + the
    signal; a `LeaseLost` (another process took the run over): its paragraph, exit 2."""
    if isinstance(stop, LeaseLost):
        print(f"dapo {command}: {stop}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    signum = int(getattr(stop, "signum", signal.SIGINT))
    name = signal.Signals(signum).name
    lines = [f"dapo {command}: stopped by {name}; committed stages and checkpoints are kept."]
    if resume:
        lines.append("Resume with: " + " ".join(resume.split()))
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 128 + signum


def run_reported(
    command: str,
    body: Callable[[], int],
    *,
    debug: bool,
    state: dict,
    resume: Callable[[], str] | None = None,
) -> int:
    """Run `body` (a command's work) under `stop_on_signals` and end every way it can in one paragraph: a
    stop (`report_stop`, with `resume()` once `state` has a "run_id"), a `DapoUserError` anywhere in the
    exception (`report_error`, exit 2), anything else (`report_crash`, exit 1). `state["run_dir"]`, once
    known, is where the log file with the traceback goes."""
    try:
        with stop_on_signals():
            return body()
    except KeyboardInterrupt as stop:  # StopRequested (our handler or a wait on Ray), LeaseLost
        hint = resume() if resume is not None and state.get("run_id") else ""
        return report_stop(stop, command, resume=hint)
    except Exception as exc:
        code = report_error(exc, command, debug=debug, run_dir=state.get("run_dir"))
        if code is None:  # not the input: one paragraph naming the log file with the traceback
            return report_crash(exc, command, debug=debug, run_dir=state.get("run_dir"))
        return code


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
