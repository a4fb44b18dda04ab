"""DVC lineage in a fresh clone: `dvc repro` runs prepare → base model → train → evaluate on tiny
parameters (the module's `lineage` fixture, checked by the first test); a second repro is a no-op, an
evaluation parameter re-runs only evaluation, metrics and plots show; `dvc push` / `dvc pull` restore data,
models and metrics in another fresh clone. All tests work on the one clone, in this order."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parents[2]
DVC = ROOT / ".venv" / "bin" / "dvc"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not DVC.exists(), reason="dvc is installed in .venv by `make setup`"),
]

TINY = {  # a few seconds per stage; the shapes of tests/integration/conftest.tiny_overrides, but a 10-step
    # SFT warm-up: the lineage's checks read which stages ran and what they wrote, not how well the model does
    "data": {"train_batch_size": 4, "gen_batch_size": 8, "synthetic": {"num_train": 400, "num_val": 16}},
    "actor_rollout_ref": {
        "model": {"sft": {"steps": 10}},
        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 8},
        "rollout": {"n": 4},
    },
    "algorithm": {"filter_groups": {"enable": False}},
    "trainer": {"total_training_steps": 2, "save_freq": 1, "test_freq": 2, "use_ray": False},
    "eval": {"n": 2},
}
OUTPUTS = (
    "data/train.parquet",
    "data/val.parquet",
    "data/stats.json",
    "models/tiny_base/model.safetensors",
    "models/dapo_final/model.safetensors",
    "models/checkpoints/step_1/model.safetensors",
    "models/checkpoints/step_2/model.safetensors",
    "metrics/train.json",
    "metrics/train_curves.csv",
    "metrics/eval_base.json",
    "metrics/eval.json",
)


def _merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        dst[k] = _merge(dst.get(k, {}), v) if isinstance(v, dict) else v
    return dst


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _clone(dst: Path, env: dict) -> Path:
    """A fresh `git clone` of this repository (its committed tree) with the project venv linked in."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dst)], check=True, env=env)
    (dst / ".venv").symlink_to(ROOT / ".venv")
    return dst


def _ran(out: str) -> set[str]:
    return {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")}


def _dvc(env: dict, cwd: Path, *args: str) -> str:
    p = subprocess.run([str(DVC), *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert p.returncode == 0, f"dvc {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def lineage(tmp_path_factory, prefect_home) -> tuple[Path, dict, str]:
    """A fresh clone on tiny parameters after its first `dvc repro`: (the clone, the environment its stage
    commands run in, what the repro printed). The ~10 stage commands of this module report to the test run's
    Prefect server (PREFECT_API_URL, set by conftest)."""
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING", "RAY_USAGE_STATS_ENABLED": "0"}
    repo = _clone(tmp_path_factory.mktemp("lineage") / "clone", env)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["base"] == "configs/tiny_cpu.yaml" and params["eval"]["checkpoint"] == "models/dapo_final"
    (repo / "params.yaml").write_text(yaml.safe_dump(_merge(params, TINY)))
    dvc_yaml = (repo / "dvc.yaml").read_text()
    assert "milestones: 10,30" in dvc_yaml
    (repo / "dvc.yaml").write_text(dvc_yaml.replace("milestones: 10,30", "milestones: 1,2"))
    # never the real-data stage (pipelines/dapo_math/dvc.yaml): it would download
    return repo, env, _dvc(env, repo, "repro")


@pytest.mark.timeout(1500)
def test_fresh_clone_repro_runs_every_stage_and_records_the_lineage(lineage):
    repo, _, first = lineage
    assert _ran(first) == {"prepare", "base_model", "train", "evaluate_base", "evaluate"}, first
    for rel in OUTPUTS:
        assert (repo / rel).stat().st_size > 0, rel
    train = json.loads((repo / "metrics" / "train.json").read_text())
    assert train["train_steps"] == 2 and train["run_id"].startswith("dvc-")
    assert (repo / "runs" / train["run_id"] / "ckpt" / "latest").exists()  # the run store, outside DVC
    curves = (repo / "metrics" / "train_curves.csv").read_text().splitlines()
    assert curves[0].startswith("step,score,acc") and len(curves) == 3
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"prepare", "base_model", "train", "evaluate_base", "evaluate"}


@pytest.mark.timeout(900)
def test_repro_again_is_a_noop_and_an_eval_parameter_reruns_only_evaluation(lineage, tmp_path):
    repo, env, _ = lineage
    assert _ran(_dvc(env, repo, "repro")) == set()  # nothing changed: a no-op

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["eval"]["top_p"] = 0.9  # an evaluation parameter: only the evaluation stages re-run
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    final_md5 = _md5(repo / "models" / "dapo_final" / "model.safetensors")
    assert _ran(_dvc(env, repo, "repro")) == {"evaluate_base", "evaluate"}
    assert _md5(repo / "models" / "dapo_final" / "model.safetensors") == final_md5

    shown = _dvc(env, repo, "metrics", "show", "--json")
    assert "metrics/eval.json" in shown and "metrics/train.json" in shown and "data/stats.json" in shown
    _dvc(env, repo, "plots", "show", "-o", str(tmp_path / "plots"))
    assert (tmp_path / "plots" / "index.html").stat().st_size > 0


@pytest.mark.timeout(900)
def test_push_then_pull_in_another_fresh_clone_restores_every_output(lineage, tmp_path):
    repo, env, _ = lineage
    remote = tmp_path / "remote"
    _dvc(env, repo, "remote", "add", "--local", "-d", "ci", str(remote))
    _dvc(env, repo, "push")
    other = _clone(tmp_path / "other", env)
    for name in ("params.yaml", "dvc.yaml", "dvc.lock"):  # the state the first clone would commit
        (other / name).write_text((repo / name).read_text())
    _dvc(env, other, "remote", "add", "--local", "-d", "ci", str(remote))
    _dvc(env, other, "pull", "dvc.yaml")  # the default lineage (pipelines/ hold lineages nobody ran here)
    for rel in OUTPUTS:
        assert _md5(other / rel) == _md5(repo / rel), rel
    status = _dvc(env, other, "status", "dvc.yaml")  # the default lineage: everything restored
    assert "up to date" in status.lower() or status.strip() == "", status
    # the whole project: only the stages of pipelines/ (real data, the real model), which nobody ran here
    listed = {
        line.rstrip(":") for line in _dvc(env, other, "status").splitlines() if line and line[0] != "\t"
    }
    assert "pipelines/dapo_math/dvc.yaml:prepare_dapo_math" in listed, listed
    assert all(s.startswith(("pipelines/dapo_math/", "pipelines/smollm2/")) for s in listed), listed
