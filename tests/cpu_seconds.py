"""CPU seconds per test: with `DAPO_RECORD_DURATIONS=<file>` set, each test's setup + call + teardown CPU
time is written to `<file>.cpu.json` and the 30 costliest tests are listed at the end of the run.

What is counted: the pytest process (its threads, the flows it runs in-process) and every child process it
waited for, with the descendants those waited for: the `dapo` subprocesses and the servers a test starts
and stops. What is not: processes that end as orphans, above all Ray's worker processes (the raylet does not
reap them when it stops), and the run's shared Prefect server. So a test that runs Ray workers costs more
than its figure here; `accton` process accounting gives the whole machine's picture.

On the 2-core CI machine the suite keeps both cores busy, so the wall time of the run follows the CPU its
processes spend, not the seconds any one test waits."""

from __future__ import annotations

import json
import os
import resource
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

RECORD_ENV = "DAPO_RECORD_DURATIONS"
_KEY = "cpu_s"
_recorded: dict[str, float] = defaultdict(float)


def _cpu_now() -> float:
    """User + system seconds of this process and of its waited-for descendants."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Attach the CPU seconds of this phase (setup, call or teardown) to its report, which pytest-xdist
    carries from the worker to the controller."""
    outcome = yield
    if not os.environ.get(RECORD_ENV):
        return
    start, now = getattr(item, "_dapo_cpu_mark", None), _cpu_now()
    item._dapo_cpu_mark = now  # type: ignore[attr-defined]
    if start is not None:
        outcome.get_result().user_properties.append((_KEY, now - start))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Mark the CPU clock where the test's setup begins."""
    if os.environ.get(RECORD_ENV):
        item._dapo_cpu_mark = _cpu_now()  # type: ignore[attr-defined]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each test's phases (in the controller, the reports its workers sent)."""
    for key, value in report.user_properties:
        if key == _KEY:
            _recorded[report.nodeid] += float(value)


def merge_recorded(session: pytest.Session, seconds: dict[str, float], suffix: str = "") -> None:
    """In the process that ran the session, merge `seconds` per test (0.1 s steps, tests under 1 s left
    out) into the JSON file `<DAPO_RECORD_DURATIONS><suffix>` (`make check` runs pytest three times)."""
    path = os.environ.get(RECORD_ENV)
    if path and seconds and not hasattr(session.config, "workerinput"):
        out = Path(path + suffix)
        known = json.loads(out.read_text()) if out.exists() else {}
        known.update({k: round(v, 1) for k, v in seconds.items() if v >= 1.0})
        out.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Merge the recorded CPU seconds into `<DAPO_RECORD_DURATIONS>.cpu.json`."""
    merge_recorded(session, _recorded, ".cpu.json")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """List the 30 tests that spent the most CPU, with the total, when recording."""
    if not _recorded:
        return
    top = sorted(_recorded.items(), key=lambda kv: -kv[1])[:30]
    terminalreporter.section("most CPU seconds (pytest and the subprocesses it waited for; not Ray workers)")
    for nodeid, seconds in top:
        terminalreporter.write_line(f"{seconds:8.1f} cpu-s  {nodeid}")
    terminalreporter.write_line(f"{sum(_recorded.values()):8.1f} cpu-s  in all {len(_recorded)} tests")
