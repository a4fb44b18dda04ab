"""Same parameters, same base model: the `dapo base` stage as `make train` (OMP_NUM_THREADS=1), `make repro`
and a plain `dvc repro` (a shell whose OMP_NUM_THREADS says 2) run it, from params.yaml (the command of the
DVC `base_model` stage), builds bitwise-equal weights: torch's threads come from `trainer.num_threads`, never
from the environment, and the recipe the base model records names them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # real CLI processes with a temporary Prefect server each


def _base(tmp: Path, name: str, data: Path, omp: str | None, *extra: str) -> Path:
    """Run `dapo base --config params.yaml` (the DVC stage's command) into tmp/name; return the model."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_API_URL", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    env.update({"PREFECT_HOME": str(tmp / f"home_{name}"), "PYTHONPATH": str(ROOT)})
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    overrides = [
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        f"trainer.models_dir={tmp / name}",
        "actor_rollout_ref.model.sft.steps=12",
        *extra,
    ]
    r = subprocess.run(
        [sys.executable, "-m", "flows.cli", "base", "--config", "params.yaml", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return tmp / name / "tiny_base"


def _digest(model: Path) -> str:
    return hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()


def test_base_model_does_not_depend_on_the_shells_thread_settings(tmp_path):
    from dapo_core.data.datasets import make_synthetic_splits, write_parquet

    train, _ = make_synthetic_splits(200, 8, seed=0)
    data = tmp_path / "train.parquet"
    write_parquet(train, data)
    make = _base(tmp_path, "make", data, "1")
    shell = _base(tmp_path, "shell", data, "2")
    assert _digest(make) == _digest(shell)
    recipe = json.loads((make / "base_model_recipe.json").read_text())
    assert recipe["numerics"] == {"num_threads": 1, "deterministic": False}
    # What makes the shell irrelevant: the warm-up runs under the configured thread count, whatever
    # OMP_NUM_THREADS said when torch started. (Whether 1 and 2 threads give different weights depends on the
    # CPU's GEMM kernels; on some machines this tiny warm-up is bitwise the same on both.)
    import torch

    from dapo_core.compute.numerics import torch_numerics

    outside = torch.get_num_threads()
    for threads in (1, 2):
        with torch_numerics(threads, False):
            assert torch.get_num_threads() == threads
    assert torch.get_num_threads() == outside
