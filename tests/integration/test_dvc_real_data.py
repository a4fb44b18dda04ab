"""The real-data DVC stage (pipelines/dapo_math/dvc.yaml) in a fresh clone: the default `dvc repro` never
collects it (it would download from the hub), and `dvc repro pipelines/dapo_math/dvc.yaml` prepares
DAPO-Math-17k / AIME-2024 from local parquet files shaped like the hub's, records them in its own dvc.lock,
is a no-op the second time and re-runs when a parameter changes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml  # type: ignore[import-untyped]

from dapo_core.data.datasets import make_synthetic_math, write_parquet

ROOT = Path(__file__).resolve().parents[2]
DVC = ROOT / ".venv" / "bin" / "dvc"
STAGE = "pipelines/dapo_math/dvc.yaml"
NAME = f"{STAGE}:prepare_dapo_math"  # how dvc names a stage of another dvc.yaml
pytestmark = pytest.mark.skipif(not DVC.exists(), reason="dvc is installed in .venv by `make setup`")


def _ran(out: str) -> set[str]:
    return {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")}


@pytest.mark.timeout(900)
def test_real_data_stage_runs_only_when_asked(tmp_path, prefect_home):
    rows = make_synthetic_math(10, min_value=0, max_value=50, num_operands=2, ops=["+"], seed=4)
    for r in rows:
        r["data_source"] = "math_dapo"  # the hub files' source tag (the DAPO math verifier)
    write_parquet(rows * 5, tmp_path / "hub" / "dapo-math-17k.parquet")  # each problem 5x (the hub: ~100x)
    write_parquet(rows[:3] * 4, tmp_path / "hub" / "aime-2024.parquet")

    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"}  # the test run's Prefect server (conftest)
    repo = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True, env=env)
    (repo / ".venv").symlink_to(ROOT / ".venv")
    shutil.copytree(ROOT / "pipelines", repo / "pipelines", dirs_exist_ok=True)  # the files under test

    def dvc(*args: str) -> str:
        p = subprocess.run([str(DVC), *args], cwd=repo, env=env, capture_output=True, text=True, check=False)
        assert p.returncode == 0, f"dvc {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout

    # a plain `dvc repro` reproduces the stages of ./dvc.yaml, the default target of `dvc stage list` too
    # (tests/integration/test_dvc_lineage.py runs that repro and checks which stages ran)
    default = {line.split()[0] for line in dvc("stage", "list").splitlines() if line.strip()}
    assert default == {"prepare", "base_model", "train", "evaluate_base", "evaluate"}, default
    assert NAME in dvc("stage", "list", "--all")

    params_path = repo / "pipelines" / "dapo_math" / "params.yaml"
    params = yaml.safe_load(params_path.read_text())
    assert params["data"]["source_files"]["train"].startswith("https://huggingface.co/")  # the default
    params["data"]["source_files"] = {
        "train": str(tmp_path / "hub" / "dapo-math-17k.parquet"),
        "val": str(tmp_path / "hub" / "aime-2024.parquet"),
    }
    params_path.write_text(yaml.safe_dump(params))

    assert _ran(dvc("repro", STAGE)) == {NAME}
    out = repo / "data" / "dapo_math"
    assert pq.read_table(out / "dapo-math-17k.parquet").num_rows == 50  # duplicates kept (data.dedup)
    assert pq.read_table(out / "aime-2024.parquet").num_rows == 12
    lock = yaml.safe_load((repo / "pipelines" / "dapo_math" / "dvc.lock").read_text())
    outs = {o["path"] for o in lock["stages"]["prepare_dapo_math"]["outs"]}
    assert outs == {
        f"data/dapo_math/{n}" for n in ("dapo-math-17k.parquet", "aime-2024.parquet", "stats.json")
    }
    shown = json.loads(dvc("metrics", "show", "--json", "data/dapo_math/stats.json"))
    assert json.dumps(shown).count('"duplicates": 40') == 1

    assert _ran(dvc("repro", STAGE)) == set()  # unchanged: a no-op

    params["data"]["dedup"] = True
    params_path.write_text(yaml.safe_dump(params))
    assert _ran(dvc("repro", STAGE)) == {NAME}
    assert pq.read_table(out / "dapo-math-17k.parquet").num_rows == 10
    assert not (repo / "data" / "train.parquet").exists()  # the default lineage was not touched
