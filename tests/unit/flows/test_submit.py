"""What `dapo submit` would send, built without a cluster: the entrypoint (run id fixed, relative paths made
absolute, the config relative to the uploaded checkout or absolute with --installed), the runtime
environment (working_dir and its excludes, or none; forwarded and --env variables) and the job id."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from dapo_core.config import load_config
from dapo_core.errors import DapoUserError
from flows.submit import FORWARDED_ENV, _next_attempt, build_submission, job_server_address, path_overrides

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "configs/tiny_cpu.yaml"


def test_the_job_carries_the_checkout_the_run_id_and_absolute_paths(monkeypatch, tmp_path):
    for key in FORWARDED_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")
    overrides = ["trainer.total_training_steps=2", "trainer.experiment_name=old", "eval.n=2"]
    cfg = load_config(ROOT / CONFIG, overrides)
    sub = build_submission(
        config=CONFIG,
        overrides=overrides,
        cfg=cfg,
        run_id="r1",
        flow_only=True,
        installed=False,
        working_dir=ROOT,
        env_pairs=["A=b=c"],
        cwd=ROOT,
        attempt=0,
    )
    argv = shlex.split(sub.entrypoint)
    assert argv[:7] == ["python", "-m", "flows.cli", "train", "--flow-only", "--config", CONFIG]
    assert argv[-1] == "trainer.experiment_name=r1"
    assert "trainer.experiment_name=old" not in argv
    assert f"trainer.runs_dir={ROOT / 'runs'}" in argv
    assert f"data.train_files=[{ROOT / 'data' / 'train.parquet'}]" in argv
    assert sub.submission_id == "dapo-r1" and sub.metadata == {"dapo_run_id": "r1"}
    assert sub.runtime_env["working_dir"] == str(ROOT)
    assert {".git", ".venv*", "/runs/", ".mypy_cache"} <= set(sub.runtime_env["excludes"])
    assert sub.runtime_env["env_vars"] == {"NCCL_SOCKET_IFNAME": "eth7", "A": "b=c"}
    # the overrides the job gets load to the same run, with every path absolute
    again = load_config(ROOT / CONFIG, argv[7:])
    assert again.trainer.experiment_name == "r1"
    assert Path(again.trainer.runs_dir).is_absolute()
    assert path_overrides(again, tmp_path) == []


def test_installed_uploads_nothing_and_names_the_config_by_its_path(tmp_path):
    cfg = load_config(ROOT / CONFIG, [f"trainer.runs_dir={tmp_path}"])
    sub = build_submission(
        config=CONFIG,
        overrides=[],
        cfg=cfg,
        run_id="r2",
        flow_only=False,
        installed=True,
        working_dir=ROOT,
        python="/opt/venv/bin/python",
        cwd=ROOT,
        attempt=2,
    )
    argv = shlex.split(sub.entrypoint)
    assert argv[:6] == ["/opt/venv/bin/python", "-m", "flows.cli", "train", "--config", str(ROOT / CONFIG)]
    assert not any(a.startswith("trainer.runs_dir=") for a in argv)  # already absolute
    assert "working_dir" not in sub.runtime_env and sub.submission_id == "dapo-r2-2"


def test_an_env_pair_without_a_name_and_a_missing_address_are_refused(monkeypatch):
    cfg = load_config(ROOT / CONFIG, [])
    with pytest.raises(DapoUserError, match="--env '=x' is not NAME=VALUE"):
        build_submission(
            config=CONFIG,
            overrides=[],
            cfg=cfg,
            run_id="r",
            flow_only=False,
            installed=True,
            working_dir=ROOT,
            env_pairs=["=x"],
        )
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(DapoUserError, match="needs the address"):
        job_server_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://head:8265")
    assert job_server_address(None) == "http://head:8265"
    assert job_server_address("http://other:8265") == "http://other:8265"


def test_a_resubmission_takes_the_first_free_job_id():
    assert _next_attempt("r", set()) == 0
    assert _next_attempt("r", {"dapo-r"}) == 1
    assert _next_attempt("r", {"dapo-r", "dapo-r-2"}) == 1  # a deleted job leaves a gap
    assert _next_attempt("r", {"dapo-r", "dapo-r-1", "dapo-r-2"}) == 3
