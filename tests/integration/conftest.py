"""Shared fixtures for integration tests: an isolated Prefect home, small data and a tiny base model, the
3-step reference run (trained once per test run, read-only: a test that changes a run works on
`copy_run`'s copy), and the crash tests' `kill_at` / `kill_and_resume`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import build_once, run_tmp, wait_for

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_cpu.yaml"


@pytest.fixture(scope="session", autouse=True)
def prefect_home(tmp_path_factory) -> Iterator[Path]:
    """One real Prefect server for the whole test run (`prefect server start` on a free loopback port, its
    own PREFECT_HOME and SQLite, without the loop services no test here needs: `SHARED_SERVER_SERVICES_OFF`),
    shared by every flow the integration tests run: in every pytest-xdist worker (the first one to need it
    starts it, the others use it: `shared_prefect_server`) and in every `dapo` subprocess (PREFECT_API_URL in
    the environment they inherit), so no process starts its own ephemeral API. Runs are told apart by their
    run names and ids. tests/conftest.py stops the server once the whole run is over. Yields its
    PREFECT_HOME. Tests whose subject is the server itself (its crash, its UI, deployments) start their own
    with `prefect_server()`, with Prefect's default services."""
    from prefect.context import refresh_global_settings_context

    from tests.integration.prefect_server import SHARED_SERVER_SERVICES_OFF, shared_prefect_server

    env = {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
    }
    # the process that runs the session: the xdist controller (a worker's parent), or this process
    owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    api, home = shared_prefect_server(run_tmp(tmp_path_factory), owner, **env, **SHARED_SERVER_SERVICES_OFF)
    # SHARED_SERVER_SERVICES_OFF stays out of this environment: servers that tests start inherit it
    env.update({"PREFECT_HOME": str(home), "PREFECT_API_URL": api})
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    refresh_global_settings_context()  # Prefect read its settings when a test module imported it
    try:
        yield home
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        refresh_global_settings_context()


def kill_at(victim: subprocess.Popen, marker: Path, timeout_s: float = 600, log: Path | None = None) -> None:
    """SIGKILL ``victim``'s whole process group (it must run with ``start_new_session=True``) as soon as
    ``marker`` exists; fail if the run ends first or the marker does not appear within ``timeout_s`` (with
    the tail of ``log``, the victim's output, in the message)."""
    wait_for(
        lambda: _exists_while_running(marker, victim, log),
        f"{marker} to appear (the moment to kill the run)",
        timeout_s,
    )
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()


def train_cmd(overrides: list[str]) -> list[str]:
    """`dapo train --flow-only` of the tiny config with `overrides`, as a subprocess command."""
    return [sys.executable, "-m", "flows.cli", "train", "--flow-only", "--config", str(CONFIG), *overrides]


def train_here(overrides: list[str]) -> dict:
    """The training `train_cmd(overrides)` runs, in this process (the dapo-train flow; run id =
    `trainer.experiment_name`): a crash test's resume where the command line is not what the test checks."""
    from dapo_core.config import load_config, to_yaml
    from flows.dapo_train import dapo_train

    return dapo_train(to_yaml(load_config(CONFIG, overrides)), "")


def actor_weights(run: Path, step: int) -> dict:
    """The actor's tensors of checkpoint `step` of the run folder `run`: its weights, or a LoRA run's adapter
    (torch imported only here)."""
    from safetensors.torch import load_file

    from dapo_core.compute.lora import ADAPTER_SUBDIR, ADAPTER_WEIGHTS

    actor = run / "ckpt" / f"step_{step}" / "actor"
    weights = actor / "model.safetensors"
    return load_file(str(weights if weights.exists() else actor / ADAPTER_SUBDIR / ADAPTER_WEIGHTS))


def assert_same_weights(a: Path, b: Path, step: int) -> None:
    """The actor weights of checkpoint `step` of runs `a` and `b` are equal bit for bit (same names too)."""
    import torch

    wa, wb = actor_weights(a, step), actor_weights(b, step)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def kill_and_resume(
    cmd: list[str],
    run: Path,
    marker: str,
    *,
    env: dict[str, str] | None = None,
    after_kill: Callable[[Path], None] | None = None,
    kill: Callable[[subprocess.Popen], None] | None = None,
    resume_cmd: list[str] | None = None,
    resume_env: dict[str, str] | None = None,
    resume: Callable[[], object] | None = None,
    reference: Path | None = None,
    step: int = 3,
    log: Path | None = None,
    timeout_s: float = 600,
) -> subprocess.CompletedProcess | None:
    """The crash test: start `cmd` (a training of the run folder `run`) in its own session, with its output in
    `log` (discarded without one); once `run / marker` exists, SIGKILL its process group (or call `kill` on
    it, which must leave it ended); call `after_kill(run)`, the checks of what the kill left; run `resume_cmd`
    (default `cmd`; environment `resume_env`, default `env`) to the end, which must exit 0, or call `resume`
    instead (the resume in this process, which saves a process start when the command line is not what the
    test checks); with `reference`, assert the actor weights of checkpoint `step` equal the reference run's
    bit for bit. Returns the finished resume command (output captured as text), or None after `resume`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env
    out = log.open("w") if log is not None else subprocess.DEVNULL
    try:
        victim = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        if log is not None:
            out.close()
    try:
        if kill is None:
            kill_at(victim, run / marker, timeout_s, log)
        else:
            wait_for(
                lambda: _exists_while_running(run / marker, victim, log),
                f"{run / marker} to appear (the moment to kill the run)",
                timeout_s,
            )
            kill(victim)
            assert victim.poll() is not None, "kill() left the run running"
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
    if after_kill is not None:
        after_kill(run)
    done = None
    if resume is not None:
        resume()
    else:
        again = resume_env if resume_env is not None else env
        done = subprocess.run(
            resume_cmd or cmd, env=again, cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if reference is not None:
        assert_same_weights(reference, run, step)
    return done


def _exists_while_running(path: Path, victim: subprocess.Popen, log: Path | None) -> bool:
    """Whether `path` exists; fail (with the tail of `log`) once `victim` has ended without it."""
    if path.exists():
        return True
    if victim.poll() is not None:
        tail = log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""
        raise AssertionError(f"the run ended (exit {victim.returncode}) before it could be killed\n{tail}")
    return False


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
    """Synthetic data and a briefly warmed-up tiny base model, built once per test run by the real flows."""
    from dapo_core.config import load_config, to_yaml
    from flows.base_model import base_model_flow
    from flows.prepare_data import prepare_data_flow

    def build(root: Path) -> None:
        cfg = load_config(CONFIG, tiny_overrides(root))
        prepare_data_flow(to_yaml(cfg))
        base_model_flow(to_yaml(cfg))

    return build_once(tmp_path_factory, "tiny", build)


SECRET = "s3cr3t-value-never-on-disk"
"""The value of DAPO_TEST_API_KEY while the reference run trains: its config names the variable, never it."""
REFERENCE_RUN = {
    **SHORT_RUN,
    "trainer.experiment_name": "short",
    "trainer.project_name": "${oc.env:DAPO_TEST_API_KEY}",  # a secret referenced from the environment
}
"""Overrides of the reference run: `SHORT_RUN`, named `short`, whose project name is a secret kept in the
environment (DAPO_TEST_API_KEY)."""


def reference_overrides(root: Path, runs_dir: Path | None = None, **extra) -> list[str]:
    """`tiny_overrides` of the reference run (with its run folder under `runs_dir` when given)."""
    runs = {} if runs_dir is None else {"trainer.runs_dir": str(runs_dir)}
    return tiny_overrides(root, **{**REFERENCE_RUN, **runs, **extra})


def _contents(run: Path) -> dict[str, str]:
    """sha256 of every file of the run folder but the ledger database (which readers open) and the trust
    records readers add beside stage files."""
    import hashlib

    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and not p.name.startswith(("ledger.sqlite", "."))
    }


@pytest.fixture(scope="session")
def short_reference(tiny_assets, tmp_path_factory) -> Iterator[Path]:
    """The uninterrupted 3-step reference run (`REFERENCE_RUN`, in-process workers, every step folder kept),
    trained once per test run by the real dapo-train flow; yields its run folder. Read it only: a test
    that changes a run (resumes, corrupts, moves it) works on `copy_run(short_reference, ...)`; at the end of
    the session its files must be as trained."""
    from dapo_core.config import load_config, to_yaml
    from flows.dapo_train import dapo_train

    def build(folder: Path) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DAPO_TEST_API_KEY", SECRET)
            cfg = load_config(CONFIG, reference_overrides(tiny_assets, folder / "runs"))
            out = dapo_train(to_yaml(cfg), REFERENCE_RUN["trainer.experiment_name"])
        assert out["train_step"] == 3
        (folder / "run_dir.txt").write_text(out["run_dir"])

    run = Path((build_once(tmp_path_factory, "reference", build) / "run_dir.txt").read_text())
    trained = _contents(run)
    yield run
    now = _contents(run)
    changed = sorted(k for k in trained.keys() | now.keys() if trained.get(k) != now.get(k))
    assert not changed, f"a test changed the read-only reference run {run}: {changed[:10]}"


def copy_run(run: Path, runs_dir: Path) -> Path:
    """A copy of the run folder `run` as `runs_dir/<its name>` (a run is named by its folder); returns it."""
    dst = runs_dir / run.name
    shutil.copytree(run, dst, symlinks=True)
    return dst
