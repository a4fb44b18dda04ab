"""The flow-run console: task runs' info lines off (errors, flow-run lines kept); DAPO_WORKER_LOGS=1: on."""

from __future__ import annotations

import io
import logging

import prefect.main  # noqa: F401  (Prefect configures logging at import: before the test's handler)

from flows.ui_state import quiet_task_run_console


def _console_lines(monkeypatch, **env: str) -> str:
    for k in ("DAPO_WORKER_LOGS", "DAPO_TASK_LOGS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    root = logging.getLogger()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    monkeypatch.setattr(root, "handlers", [handler])  # the console handler Prefect puts on the root logger
    quiet_task_run_console()
    quiet_task_run_console()  # twice: one filter
    assert len(handler.filters) == (0 if env else 1)
    for name, level, text in (
        ("prefect.task_runs", logging.INFO, "Finished in state Completed()"),
        ("prefect.task_runs", logging.ERROR, "Task run failed"),
        ("prefect.flow_runs", logging.INFO, "step 3 done"),
    ):
        handler.handle(logging.LogRecord(name, level, __file__, 1, text, None, None))
    return out.getvalue()


def test_task_run_info_lines_are_off_the_console_errors_and_flow_lines_stay(monkeypatch):
    text = _console_lines(monkeypatch)
    assert "Finished in state" not in text
    assert "Task run failed" in text and "step 3 done" in text


def test_worker_logs_bring_task_run_lines_back(monkeypatch):
    assert "Finished in state" in _console_lines(monkeypatch, DAPO_WORKER_LOGS="1")
