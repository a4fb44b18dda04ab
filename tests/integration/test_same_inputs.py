"""Same parameters, same base model: the `base_model` stage as a plain `dvc repro` runs it (a shell whose
OMP_NUM_THREADS and MKL_NUM_THREADS say 2), as `make repro` runs it (the same `dvc repro` with the variables
unset), and the base model `make train` builds (`dapo base --config configs/tiny_cpu.yaml` with the same
parameters on the command line, OMP_NUM_THREADS=1) are bitwise equal: torch's threads come from
`trainer.num_threads`, never from the environment, and the recipe the base model records names them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DVC = ROOT / ".venv" / "bin" / "dvc"

pytestmark = [
    pytest.mark.slow,  # real CLI processes (dvc, dapo)
    pytest.mark.skipif(not DVC.exists(), reason="dvc is installed in .venv by `make setup`"),
]


def _params() -> dict:
    """params.yaml with a small data set and a short warm-up (every other key as committed)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"]["synthetic"].update({"num_train": 200, "num_val": 8})
    params["actor_rollout_ref"]["model"]["sft"]["steps"] = 4
    return params


def _env(tmp: Path, name: str, threads: str | None) -> dict[str, str]:
    """The environment of one way of building: its own PREFECT_HOME, the test run's Prefect server (the
    inherited PREFECT_API_URL) and the given thread variables (none when `threads` is None)."""
    drop = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PREFECT_HOME"] = str(tmp / f"home_{name}")
    if threads is not None:
        env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _dvc_base(tmp: Path, name: str, threads: str | None) -> Path:
    """`dvc repro base_model` (prepare, then the warm-up) in a fresh workspace of the project; the model."""
    ws = tmp / name
    ws.mkdir()
    for entry in ("dapo_core", "flows", "tasks", "configs", ".venv"):
        (ws / entry).symlink_to(ROOT / entry)
    shutil.copy(ROOT / "dvc.yaml", ws / "dvc.yaml")
    (ws / "params.yaml").write_text(yaml.safe_dump(_params(), sort_keys=False))
    env = _env(tmp, name, threads)
    _run(["git", "init", "-q"], ws, env)
    _run([str(DVC), "init", "-q"], ws, env)
    _run([str(DVC), "repro", "base_model"], ws, env)
    return ws / "models" / "tiny_base"


def _overrides(tree: dict, prefix: str = "") -> Iterator[str]:
    """Dotted command-line overrides that set every leaf of `tree`."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _overrides(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            yield f"{prefix}{key}=[{','.join(map(str, value))}]"
        else:
            yield f"{prefix}{key}={json.dumps(value) if isinstance(value, bool) or value is None else value}"


def _make_train_base(tmp: Path, data: Path) -> Path:
    """The base model as `make train` builds it: configs/tiny_cpu.yaml and the same parameters."""
    params = {k: v for k, v in _params().items() if k not in ("base", "eval")}
    cmd = [sys.executable, "-m", "flows.cli", "base", "--config", "configs/tiny_cpu.yaml"]
    cmd += [*_overrides(params), f"data.train_files=[{data}]", f"trainer.models_dir={tmp / 'make'}"]
    _run(cmd, ROOT, {**_env(tmp, "make", "1"), "PYTHONPATH": str(ROOT)})
    return tmp / "make" / "tiny_base"


def _digest(model: Path) -> str:
    return hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.timeout(1500)
def test_dvc_repro_make_repro_and_make_train_build_the_same_base_model(tmp_path, prefect_home):
    shell = _dvc_base(tmp_path, "shell", "2")
    make_repro = _dvc_base(tmp_path, "make_repro", None)
    make_train = _make_train_base(tmp_path, tmp_path / "shell" / "data" / "train.parquet")
    assert _digest(shell) == _digest(make_repro) == _digest(make_train)
    recipe = json.loads((shell / "base_model_recipe.json").read_text())
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
