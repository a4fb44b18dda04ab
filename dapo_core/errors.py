"""The one base class for problems the user can fix, and how they are shown.

A `DapoUserError` carries three parts: *what* went wrong, *where* (a file, a row, a config key, a run) and
the *fix*. The CLI prints it as one paragraph and exits with code 2, without a traceback unless `--debug`
(or `DAPO_DEBUG=1`) is given; errors raised inside Ray workers or Prefect tasks are unwrapped back to the
original `DapoUserError` by `find_user_error`, so they reach the user the same way.

The existing error classes (`ConfigError`, `DataError`, `SchemaError`, `StoreError`, `CheckpointError`, ...)
subclass it and keep their `ValueError` base, so `except ValueError` callers are unaffected. A subclass may
still be raised with one finished message (`DataError("...")`); `where`/`fix` are then simply empty.

Nothing here imports prefect, ray or torch: `find_user_error` walks wrapper exceptions by their attributes
(`cause` as on Ray's `RayTaskError`, `__cause__`, `__context__`, exception arguments).

`StopRequested` is the one exception for "the user or the scheduler asked the run to stop" (SIGTERM/SIGINT).
"""

from __future__ import annotations

import signal

__all__ = ["EXIT_USER_ERROR", "DapoUserError", "StopRequested", "find_user_error", "one_paragraph"]

EXIT_USER_ERROR = 2
"""Process exit code for a problem the user can fix (bad config, data, model folder, checkpoint, store)."""


class DapoUserError(Exception):
    """A problem the user can fix: `what` went wrong, `where` (file, row, key, run), and the `fix`.

    `str(err)` is the one-paragraph message the CLI prints. Raise it with the three parts
    (`DapoUserError("the prompt is empty", where="data/x.parquet row 7", fix="drop the row")`) or with one
    finished message (the older style of the subclasses, whose messages already name the place and the fix).
    """

    def __init__(self, what: str = "", *args: object, where: str = "", fix: str = "") -> None:
        self.what = str(what)
        self.where = where
        self.fix = fix
        super().__init__(self.what, *args)

    def __str__(self) -> str:
        return one_paragraph(self.what, self.where, self.fix)


def one_paragraph(what: str, where: str = "", fix: str = "") -> str:
    """Join `what`, `where` and `fix` into one paragraph (parts already in the text are not repeated)."""
    text = what.strip()
    if where and where not in text:
        text = f"{text.rstrip('.')} (in {where})."
    if fix and fix not in text:
        text = f"{text.rstrip('.')}. Fix: {fix.strip()}"
    return text


def find_user_error(exc: BaseException | None, _depth: int = 0) -> DapoUserError | None:
    """Return the `DapoUserError` inside `exc`: itself, its cause/context, or the original kept by a Ray or
    Prefect wrapper (`RayTaskError.cause`, `ActorDiedError`'s cause, a state's exception); else None."""
    if exc is None or _depth > 12:
        return None
    if isinstance(exc, DapoUserError):
        return exc
    for attr in ("cause", "__cause__", "__context__"):
        inner = getattr(exc, attr, None)
        if isinstance(inner, BaseException) and inner is not exc:
            found = find_user_error(inner, _depth + 1)
            if found is not None:
                return found
    for arg in getattr(exc, "args", ()):
        if isinstance(arg, BaseException):
            found = find_user_error(arg, _depth + 1)
            if found is not None:
                return found
    return None


class StopRequested(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived: the user or the scheduler asked the run to stop, so it unwinds at the next
    safe point; `signum` is the signal.

    Raised by the `dapo` CLI's signal handler (`flows.run_guard.stop_on_signals`) and by a wait on a Ray
    worker (`dapo_core.compute.signals`): Ray's blocking wait loses exceptions that signal handlers raise in
    it, so there the handler only records the signal and the wait loop raises this. A `KeyboardInterrupt`, so
    Prefect marks the flow run Crashed and `except Exception` blocks let it through."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
