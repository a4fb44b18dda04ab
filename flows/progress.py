"""What a person sees while the CLI and the flows work: progress and a quiet, honest console.

- `Ticker`: the progress of one wait (the base-model warm-up's steps, evaluation's rows, ...): a rich bar on
  a terminal, elsewhere (a log file, CI, `dvc repro`) one line at most every `DAPO_PROGRESS_INTERVAL_S`
  seconds (the first and the last update always get a line).
- `StepProgress`: the training display (step k/N, the stage running, headline metrics, and per generation
  batch the kept groups against the groups a step needs), live on a terminal, rate-limited lines elsewhere.
- `prefect_console_env`: Prefect's usage data (and the client's first-run telemetry notice) off unless the
  user turned it on. Must run before `prefect` is imported.
- `start_local_prefect`: start the temporary local Prefect server with a start-up timeout a loaded machine
  survives, say what it waits for, turn a timeout into one paragraph; at exit let it finish its last flush
  (SIGTERM, then up to `SERVER_DRAIN_S` s) with its output off the console (`quiet_server_class`).
- `quiet_worker_noise`: transformers' and the HF hub's progress bars and info lines off (`DAPO_WORKER_LOGS=1`
  keeps them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

INTERVAL_ENV = "DAPO_PROGRESS_INTERVAL_S"
"""Environment variable: seconds between two progress lines when the console is not a terminal."""

DEFAULT_INTERVAL_S = 15.0
"""Default of `DAPO_PROGRESS_INTERVAL_S`."""


def line_interval_s() -> float:
    """Seconds between two progress lines off a terminal (`DAPO_PROGRESS_INTERVAL_S`, default 15)."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        return max(float(raw), 0.0) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S


def _stderr_console() -> Console:
    return Console(stderr=True)


def say(text: str) -> None:
    """One progress line on stderr, also inside a Prefect task (whose log lines the CLI keeps quiet)."""
    _print_line(text)


def _print_line(text: str) -> None:
    # stderr, not a log record: the CLI keeps Prefect's task-run logger at WARNING (one line per task run
    # otherwise), and a Ticker usually runs inside a task
    # (written, not printed: inside a run with log_prints Prefect turns print(), to stderr too, into a record)
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class RateLimitedLines:
    """Prints a line when `interval_s` has passed since the last one, or when told it must (first / last)."""

    def __init__(
        self,
        interval_s: float | None = None,
        printer: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = line_interval_s() if interval_s is None else interval_s
        self.printer = printer or _print_line
        self.clock = clock
        self._last: float | None = None
        self.pending: str | None = None  # the newest line not printed yet

    def offer(self, text: str, force: bool = False) -> bool:
        """Print `text` if forced or due; otherwise keep it as pending. Returns whether it was printed."""
        now = self.clock()
        if force or self._last is None or now - self._last >= self.interval_s:
            self.printer(text)
            self._last, self.pending = now, None
            return True
        self.pending = text
        return False

    def flush(self) -> None:
        """Print the pending line, if any."""
        if self.pending is not None:
            self.offer(self.pending, force=True)


class Ticker:
    """Progress of one wait of `total` units: a rich bar on a terminal, else rate-limited lines
    `<label>: <done>/<total> <unit> (<pct>%, <elapsed>s) <note>`. Use as a context manager or call `close`."""

    def __init__(
        self,
        label: str,
        total: int,
        unit: str = "",
        *,
        live: bool | None = None,
        interval_s: float | None = None,
        printer: Callable[[str], None] | None = None,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.unit = label, max(int(total), 0), unit
        self.done = 0
        self.clock = clock
        self._t0 = clock()
        console = console or _stderr_console()
        self.live = console.is_terminal if live is None else live
        self._lines = RateLimitedLines(interval_s, printer, clock)
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[note]}"),
                console=console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(label, total=self.total, note="")

    def _text(self, note: str) -> str:
        pct = f"{100 * self.done / self.total:.0f}%, " if self.total else ""
        unit = f" {self.unit}" if self.unit else ""
        tail = f" {note}" if note else ""
        return f"{self.label}: {self.done}/{self.total}{unit} ({pct}{self.clock() - self._t0:.0f}s){tail}"

    def update(self, done: int, note: str = "") -> None:
        """`done` units are finished (absolute count); `note` is shown beside the count."""
        self.done = min(int(done), self.total) if self.total else int(done)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self.done, note=note)
        else:
            self._lines.offer(self._text(note), force=self.done >= self.total)

    def advance(self, n: int = 1, note: str = "") -> None:
        """`n` more units are finished."""
        self.update(self.done + n, note)

    def close(self) -> None:
        """Stop the bar, or print the last state if its line was held back."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        else:
            self._lines.flush()

    def __enter__(self) -> Ticker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepProgress:
    """The training display: step k/N, the stage running now, headline metrics and the generation batches of
    dynamic sampling. `enabled`: the caller wants a live display; it is drawn only when the console is a
    terminal. Everywhere else the same information comes as rate-limited lines (`DAPO_PROGRESS_INTERVAL_S`),
    one per generation batch at most."""

    def __init__(
        self,
        run_id: str,
        enabled: bool = True,
        *,
        console: Console | None = None,
        printer: Callable[[str], None] | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        console = console or _stderr_console()
        self.enabled = enabled and console.is_terminal
        self.run_id = run_id
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._gen_task: TaskID | None = None
        self._lines = RateLimitedLines(interval_s, printer, clock)
        self._step, self._total = 0, 0
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[stage]}"),
                TextColumn("{task.fields[last]}"),
                console=console,
                transient=False,
                refresh_per_second=4,
            )
            self._progress.start()

    def begin_step(self, step: int, total: int) -> None:
        """A new train step starts."""
        self._step, self._total = step, total
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

    def gen_batch(self, batch: int, prompts: int, kept: int | None, need: int) -> None:
        """Generation batch `batch` (0-based) of this step is scored and filtered: `kept` informative groups
        so far of the `need` the step trains on (None: dynamic sampling is off, the batch is the step's)."""
        if kept is None:
            text, done = f"{prompts} prompts generated and scored", need
        else:
            more = "; generating more" if kept < need else ""
            text, done = f"{prompts} prompts, kept {kept}/{need} groups{more}", min(kept, need)
        if self._progress is not None:
            if self._gen_task is None:
                self._gen_task = self._progress.add_task("", total=need, stage="", last="")
            self._progress.update(
                self._gen_task,
                description=f"  step {self._step} gen batch {batch + 1}",
                total=need,
                completed=done,
                last=text,
            )
            return
        self._lines.offer(f"step {self._step}/{self._total} gen batch {batch + 1}: {text}")

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


# ------------------------------------------------------------------------------------------ the console
ANALYTICS_ENV = "PREFECT_SERVER_ANALYTICS_ENABLED"


def prefect_console_env() -> None:
    """Prefect's usage data stay off unless the user set `PREFECT_SERVER_ANALYTICS_ENABLED=true` (the server's
    heartbeat otherwise fails with a traceback on a machine without network). With it off, `DO_NOT_TRACK=1`
    (unless set) also silences the client: Prefect's first-run "collects anonymous usage data" notice and
    its SDK events only look at `DO_NOT_TRACK`. Call before `prefect` is imported (it reads both then)."""
    os.environ.setdefault(ANALYTICS_ENV, "false")
    if os.environ[ANALYTICS_ENV].strip().lower() in ("false", "0", "no", "off"):
        os.environ.setdefault("DO_NOT_TRACK", "1")


TEMPORARY_SERVER_ENV = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "50",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "2",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_READ_BATCH_SIZE": "50",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "2",
}
"""Settings of the temporary server `start_local_prefect` launches (a variable or profile setting the user
gave wins). Prefect's task-run recorder writes each task-run state event in a transaction of its own by
default (batch size 1: three events per task run); batched, it writes them every 2 s in one transaction,
which leaves the workers more of the CPU the server shares with them (bench/README.md, "Pinned A/B probes").
The event persister, which stores every event for the events API, is batched the same way (Prefect's
default: read one event at a time, write every 20). The cost: task-run states and events reach the
server's database up to 2 s late, and the temporary server has no UI to show them.
A long-lived `prefect server start` keeps Prefect's defaults unless its operator sets these."""


def start_local_prefect(
    command: str, report_every_s: float | None = None, printer: Callable[[str], None] | None = None
) -> str | None:
    """Without `PREFECT_API_URL`: start Prefect's temporary local server now (flows started later use it),
    waiting up to `prefect_startup_timeout()` s and printing a line every `report_every_s` s (default
    `DAPO_PROGRESS_INTERVAL_S`, 15) while it waits.
    Returns its API URL (None when `PREFECT_API_URL` names a server). A server that does not answer in time
    is a `PreflightError` naming the timeout variable and the alternatives."""
    from flows.run_guard import prefect_startup_timeout

    if os.environ.get("PREFECT_API_URL", "").strip():
        return None
    say = printer or (lambda text: print(text, file=sys.stderr, flush=True))
    timeout = prefect_startup_timeout()
    every = line_interval_s() if report_every_s is None else report_every_s
    say(
        f"dapo {command}: starting a temporary local Prefect server (waits up to {timeout} s; set "
        "PREFECT_API_URL to use a running one)"
    )
    for key, value in TEMPORARY_SERVER_ENV.items():  # the server process inherits the environment
        os.environ.setdefault(key, value)
    t0 = time.monotonic()
    done = threading.Event()

    def report() -> None:
        while not done.wait(max(every, 0.5)):
            say(
                f"dapo {command}: still waiting for the temporary Prefect server to answer "
                f"({time.monotonic() - t0:.0f} s; a loaded machine starts it slowly; Prefect gives up after "
                f"{timeout} s of its own polling)"
            )

    watcher = threading.Thread(target=report, name="prefect-startup-report", daemon=True)
    watcher.start()
    server: Any = quiet_server_class()()
    try:
        server.start(timeout=timeout)
    except RuntimeError as e:
        from dapo_core.preflight import PreflightError

        raise PreflightError(
            f"the temporary local Prefect server did not answer within {timeout} s "
            f"({str(e).splitlines()[0][:160]})",
            where="environment variable PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
            fix="raise it (e.g. 300) on a loaded machine, or start a server once (`prefect server start "
            "--host 127.0.0.1`) and set PREFECT_API_URL=http://127.0.0.1:4200/api",
        ) from None
    finally:
        done.set()
        watcher.join()
    say(f"dapo {command}: Prefect server ready at {server.api_url} after {time.monotonic() - t0:.0f} s")
    return str(server.api_url)


_APP = "prefect.server.api.server:create_app"

SERVER_DRAIN_S = 15.0
"""Seconds a stopping temporary server gets to finish (its recorder's last flush) before it is killed."""


def quiet_server_class() -> type:
    """Prefect's `SubprocessASGIServer` with a quiet, complete stop: the server's output passes through to the
    console while it serves; once `stop()` (at exit) begins, it goes to a log file instead, so a recorder
    flush that shutdown interrupts ("Error flushing N events" and its `CancelledError` traceback) never
    reaches the console. `stop()` sends SIGTERM, which lets the server's lifespan run the recorders' final
    flush, waits up to `SERVER_DRAIN_S` s, and only then kills it."""
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class QuietTemporaryServer(SubprocessASGIServer):
        """See `quiet_server_class`."""

        _quiet = False
        _pumps: list[threading.Thread]
        shutdown_log: Path | None = None

        def _run_uvicorn_command(self) -> Any:
            """Prefect's uvicorn command (UI off, ephemeral), with its stdout/stderr pumped by threads."""
            app = ["--app-dir", str(prefect.__module_path__.parent), "--factory", _APP]
            where = ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error"]
            proc = subprocess.Popen(
                args=[sys.executable, "-m", "uvicorn", *app, *where, "--lifespan", "on"],
                env={
                    **os.environ,
                    "PREFECT_UI_ENABLED": "0",
                    "PREFECT__SERVER_EPHEMERAL": "1",
                    "PREFECT__SERVER_FINAL": "1",
                    **get_current_settings().to_environment_variables(exclude_unset=True),
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            self._pumps = [
                threading.Thread(target=self._pump, args=(src, dst), name="prefect-server-out", daemon=True)
                for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
            ]
            for t in self._pumps:
                t.start()
            # Only the pumps read the pipes: Prefect's start-up timeout path would otherwise read them to EOF
            # (a server that never exits: a hang).
            proc.stdout = proc.stderr = None
            return proc

        def _pump(self, src: Any, dst: Any) -> None:
            for line in iter(src.readline, b""):
                if not self._quiet:
                    try:
                        dst.write(line.decode(errors="replace"))
                        dst.flush()
                        continue
                    except (OSError, ValueError):  # the console is gone (closed at exit)
                        pass
                self._keep(line)

        def _keep(self, line: bytes) -> None:
            if self.shutdown_log is None:
                folder = Path(tempfile.gettempdir()) / "dapo-errors"
                folder.mkdir(parents=True, exist_ok=True)
                self.shutdown_log = folder / f"prefect-server-stop-{os.getpid()}.log"
            with self.shutdown_log.open("ab") as f:
                f.write(line)

        def stop(self) -> None:
            """SIGTERM, wait up to `SERVER_DRAIN_S` for the final flush, then kill; output to the log file."""
            self._quiet = True
            proc = self.server_process
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=SERVER_DRAIN_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                for t in getattr(self, "_pumps", []):
                    t.join(timeout=5)
                self.server_process = None
            super().stop()

    return QuietTemporaryServer


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
