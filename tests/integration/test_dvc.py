"""`dvc repro` runs the project's real dvc.yaml `prepare` stage and tracks its outputs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DVC = ROOT / ".venv" / "bin" / "dvc"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not DVC.exists(), reason="dvc is installed in .venv by `make setup`"),
]


def test_dvc_repro_prepare_then_noop(tmp_path, prefect_home):
    for name in ("dapo_core", "flows", "tasks", "configs", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(*a):
        return subprocess.run(a, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)

    assert run("git", "init", "-q").returncode == 0
    assert run(str(DVC), "init", "-q").returncode == 0
    first = run(str(DVC), "repro", "prepare")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert (tmp_path / "data" / "train.parquet").stat().st_size > 0
    assert "prepare" in (tmp_path / "dvc.lock").read_text()
    second = run(str(DVC), "repro", "prepare")
    assert second.returncode == 0
    assert "didn't change" in second.stdout or "up to date" in second.stdout
    status = run(str(DVC), "status", "prepare")
    assert "up to date" in status.stdout.lower() or status.stdout.strip() == ""
