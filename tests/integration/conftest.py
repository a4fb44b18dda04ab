"""Shared fixtures for integration tests: an isolated Prefect home, small data and a tiny base model."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import wait_for

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory):
    """A fresh PREFECT_HOME for the session (ephemeral API, its own SQLite)."""
    home = tmp_path_factory.mktemp("prefect_home")
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield home
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def kill_at(victim: subprocess.Popen, marker: Path, timeout_s: float = 600, log: Path | None = None) -> None:
    """SIGKILL ``victim``'s whole process group (it must run with ``start_new_session=True``) as soon as
    ``marker`` exists; fail if the run ends first or the marker does not appear within ``timeout_s`` (with
    the tail of ``log``, the victim's output, in the message)."""

    def reached() -> bool:
        if marker.exists():
            return True
        if victim.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
            ended = f"the run ended (exit {victim.returncode}) before it could be killed"
            raise AssertionError(f"{ended}\n{tail}")
        return False

    wait_for(reached, f"{marker} to appear (the moment to kill the run)", timeout_s)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()


SHORT_RUN = {
    "trainer.total_training_steps": 3,
    "trainer.save_freq": 1,
    "trainer.test_freq": -1,
    "trainer.val_before_train": "false",
    "trainer.use_ray": "false",
    "algorithm.filter_groups.enable": "false",  # the briefly warmed-up model may keep no group
}
"""Overrides for a 3-step in-process run that checkpoints every step, without validation or dynamic sampling
(the resume, ledger and replay-store tests)."""


def tiny_overrides(root: Path, **extra) -> list[str]:
    """Dotted overrides that point the tiny config at `root` and shrink it for tests."""
    base = {
        "data.synthetic.out_dir": str(root / "data"),
        "data.synthetic.num_train": 400,
        "data.synthetic.num_val": 16,
        "data.train_files": f"[{root / 'data' / 'train.parquet'}]",
        "data.val_files": f"[{root / 'data' / 'val.parquet'}]",
        "trainer.models_dir": str(root / "models"),
        "trainer.runs_dir": str(root / "runs"),
        "trainer.logger": "[jsonl]",
        "actor_rollout_ref.model.sft.steps": 40,
        "data.train_batch_size": 4,
        "data.gen_batch_size": 8,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
        "eval.n": 2,
        "trainer.keep_rollouts_every": 1,  # tests inspect every step's stages (retention: test_retention)
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory, prefect_home):
    """Synthetic data and a briefly warmed-up tiny base model, built once per session by the real flows."""
    from dapo_core.config import load_config, to_yaml
    from flows.base_model import base_model_flow
    from flows.prepare_data import prepare_data_flow

    root = tmp_path_factory.mktemp("tiny")
    cfg = load_config(CONFIG, tiny_overrides(root))
    prepare_data_flow(to_yaml(cfg))
    base_model_flow(to_yaml(cfg))
    return root
