"""The bad-input probe as a table: every row feeds one bad input to the `dapo` CLI, in process
(`flows.cli.main`), and asserts what the user gets.

Each case asserts: exit code 2 (or, for the few deliberate behaviours, 0 with a note on stderr); the class of
the error (`flows.run_guard.last_user_error`); that the message names the field or file and the fix (the
`expect` substrings); that no traceback reaches stderr; and that the run store (`trainer.runs_dir`) is
byte-for-byte unchanged afterwards. The flows are replaced by recorders, so a case that got past the checks
shows up as a recorded call instead of a training run: everything here is caught before Prefect or Ray start,
which is the point of the preflight. The rest of the table (reward scores, the failure-rate limit) calls the
reward code directly; SIGTERM to a real run is in tests/integration/test_faults_cli.py. The rows, one module
per area, and the workspace and breakers they are built from are in tests/unit/bad_inputs/.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import types
from pathlib import Path

import pytest

from tests.unit.bad_inputs.cases_config import CONFIG
from tests.unit.bad_inputs.cases_data import DATA, EMPTY_DATA
from tests.unit.bad_inputs.cases_model import MODEL, SERVING
from tests.unit.bad_inputs.cases_run import CHECKPOINTS, MACHINE, WRITERS
from tests.unit.bad_inputs.workspace import (
    Case,
    Ws,
    _train,
)


# ------------------------------------------------------------------------------------------ workspace
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Good inputs, built once: train/val parquet files and a tiny model folder."""
    from tests.helpers import write_good_inputs

    return write_good_inputs(tmp_path_factory.mktemp("bad_inputs_base"))


@pytest.fixture
def ws(base: Path, tmp_path: Path) -> Ws:
    shutil.copytree(base, tmp_path / "in")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "keep").mkdir()
    (runs / "keep" / "note.txt").write_text("an existing run's file")
    i = tmp_path / "in"
    return Ws(tmp_path, i / "train.parquet", i / "val.parquet", i / "model", runs)


CASES: list[Case] = [*CONFIG, *DATA, *MODEL, *CHECKPOINTS, *SERVING, *EMPTY_DATA, *WRITERS, *MACHINE]
"""The whole table: every area's rows (tests/unit/bad_inputs/cases_*.py)."""


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.read_bytes() if p.is_file() else b"")
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def no_flows(monkeypatch) -> list:
    """Replace the flow modules by recorders: reaching one means the input got past every check."""
    calls: list = []
    for module, attr in (
        ("flows.pipeline", "pipeline"),
        ("flows.dapo_train", "dapo_train"),
        ("flows.evaluate", "evaluate_flow"),
        ("flows.prepare_data", "prepare_data_flow"),
        ("flows.base_model", "base_model_flow"),
    ):
        mod = types.ModuleType(module)
        setattr(mod, attr, lambda *a, _m=module: calls.append((_m, a)))
        monkeypatch.setitem(sys.modules, module, mod)
    return calls


def test_the_table_has_at_least_90_bad_inputs():
    assert len(CASES) >= 90 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, ws: Ws, no_flows: list, monkeypatch, capsys):
    import flows.run_guard
    from flows.cli import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("DAPO_DEBUG", raising=False)
    monkeypatch.delenv("DAPO_SKIP_PREFLIGHT", raising=False)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    if case.patch is not None:
        case.patch(monkeypatch, ws)
    monkeypatch.setattr(flows.run_guard, "last_user_error", None)
    if case.setup is not None:
        case.setup(ws)
    argv = case.argv(ws)
    before = _snapshot(ws.runs)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == case.code, err
    assert "Traceback" not in err and 'File "' not in err, err
    for part in case.expect:
        assert part in err, f"{part!r} not in: {err}"
    assert _snapshot(ws.runs) == before, "the run store changed"
    if case.code == 2:
        assert no_flows == [], "a flow started"
        got = flows.run_guard.last_user_error
        assert got is not None and case.error in [c.__name__ for c in type(got).__mro__], type(got)
        message = [ln for ln in err.splitlines() if ln.startswith(f"dapo {argv[0]}:")]
        assert message, err
    else:
        assert no_flows, "the run did not start"


def test_debug_shows_the_traceback(ws: Ws, no_flows: list, monkeypatch, capsys):
    """--debug (or DAPO_DEBUG=1) prints the traceback as well as the paragraph."""
    from flows.cli import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    shutil.rmtree(ws.model)
    assert main([*_train()(ws), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "does not exist" in err


def test_an_unexpected_failure_is_one_paragraph(ws: Ws, monkeypatch, capsys, tmp_path):
    """Not an input problem (here: the flow hits a bug): what failed, where the traceback is, and --debug."""
    from flows.cli import main

    def broken(*args: object) -> None:
        raise RuntimeError("worker 3 lost its connection\nsecond line")

    mod = types.ModuleType("flows.dapo_train")
    mod.dapo_train = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flows.dapo_train", mod)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("DAPO_DEBUG", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert main(_train()(ws)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "second line" not in err, err
    line = [ln for ln in err.splitlines() if ln.startswith("dapo train: failed with RuntimeError")]
    assert line and "worker 3 lost its connection" in line[0] and "--debug" in line[0], err
    log = Path(line[0].split("the full traceback is in ")[1].split(". Run again")[0])
    assert "Traceback" in log.read_text() and "second line" in log.read_text()
    assert main([*_train()(ws), "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


# -------------------------------------------------------------------------------- rewards (no CLI)
def _score_with(value: object) -> dict:
    from dapo_core.rewards.manager import RewardManager

    row = {
        "uid": "u1",
        "data_source": "x",
        "solution_str": "s",
        "ground_truth": "1",
        "valid_response_length": 1,
    }
    with RewardManager(lambda **kw: value, num_workers=1, inline_max_rows=8) as rm:
        res = rm.score([row])
    return {"acc": res.acc[0], "score": res.score[0], "failures": res.failures}


@pytest.mark.parametrize(
    "value", [{"score": math.nan, "acc": True}, math.nan, {"score": math.inf, "acc": True}, -math.inf]
)
def test_non_finite_score_is_a_failure_never_a_success(value):
    out = _score_with(value)
    assert out["acc"] is False and out["failures"] and "non-finite" in out["failures"][0][1]
    assert math.isfinite(out["score"])


def test_failure_rate_above_the_limit_stops_the_step(base: Path):
    from dapo_core.compute.workers.reward import RewardFailureRate, RewardWorker
    from dapo_core.errors import DapoUserError

    rows = [
        {"uid": f"u{i}", "data_source": "gsm8k" if i % 4 else "math", "ground_truth": "3"} for i in range(8)
    ]
    worker = RewardWorker(str(base / "model"), max_resp_len=8, overlong_buffer=None, num_workers=1)
    try:
        worker._check_failure_rate(rows, [(r["uid"], "no reward function") for r in rows[:4]])  # 50%: allowed
        with pytest.raises(RewardFailureRate) as exc:
            worker._check_failure_rate(
                rows, [(r["uid"], "no reward function for 'gsm8k'") for r in rows[1:6]]
            )
    finally:
        worker.close()
    msg = str(exc.value)
    assert isinstance(exc.value, DapoUserError)
    assert "reward_model.max_failure_rate=0.5" in msg and "gsm8k" in msg and "uid=u1" in msg and "Fix:" in msg


def test_scan_reports_unparsable_ground_truth_per_source():
    from dapo_core.rewards.scoring import ground_truth_problem

    assert ground_truth_problem("math", "42") is None
    assert "NaN" in (ground_truth_problem("math", math.nan) or "")
    assert "not a string" in (ground_truth_problem("math", 3) or "")
    assert "missing value" in (ground_truth_problem("math", "None") or "")


def test_worker_errors_are_unwrapped_to_the_user_error():
    """A DapoUserError raised in a Ray worker or a Prefect task reaches the CLI as itself."""
    from dapo_core.errors import DapoUserError, find_user_error

    class RayTaskErrorLike(Exception):
        def __init__(self, cause: BaseException) -> None:
            super().__init__("ray::RewardWorker.score() failed")
            self.cause = cause

    inner = DapoUserError("3 of 4 rewards failed", where="data source gsm8k", fix="fix the data")
    outer = RuntimeError("Flow run encountered an exception")
    outer.__cause__ = RayTaskErrorLike(inner)
    assert find_user_error(outer) is inner
    assert find_user_error(RuntimeError("a bug")) is None
    assert json.dumps(str(inner))  # one paragraph, printable
