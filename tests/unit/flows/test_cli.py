"""Tests of the `dapo` command line (flows.cli): config printing, exit codes, flow dispatch."""

from __future__ import annotations

import re
import sys
import types
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dapo_core.config import ConfigWarning
from flows.cli import main, make_run_id

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        yield


def _fake_flow(monkeypatch, module: str, attr: str) -> list:
    calls: list = []
    mod = types.ModuleType(module)
    setattr(mod, attr, lambda *a: calls.append(a))
    monkeypatch.setitem(sys.modules, module, mod)
    return calls


def test_config_prints_resolved_yaml_with_overrides(capsys):
    assert main(["config", "--config", TINY, "data.seed=9", "actor_rollout_ref.rollout.n=16"]) == 0
    out = OmegaConf.create(capsys.readouterr().out)
    assert out.data.seed == 9 and out.actor_rollout_ref.rollout.n == 16


def test_bad_key_exits_2_without_traceback(capsys):
    assert main(["train", "--config", TINY, "actor_rollout_ref.actor.clip_ratio_hgh=0.3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean clip_ratio_high" in err and "Traceback" not in err


def test_type_error_and_cross_check_exit_2(capsys):
    assert main(["config", "--config", TINY, "data.train_batch_size=abc"]) == 2
    assert "data.train_batch_size" in capsys.readouterr().err
    assert main(["prepare", "--config", TINY, "actor_rollout_ref.actor.clip_ratio_c=1"]) == 2
    assert "clip_ratio_c" in capsys.readouterr().err


def test_missing_config_file_exits_2(capsys):
    assert main(["config", "--config", "nope.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_generates_run_id_and_calls_pipeline(monkeypatch, capsys):
    calls = _fake_flow(monkeypatch, "flows.pipeline", "pipeline")
    assert main(["train", "--config", TINY, "trainer.total_training_steps=2"]) == 0
    ((cfg_yaml, run_id),) = calls
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", run_id)
    assert run_id in capsys.readouterr().out
    cfg = OmegaConf.create(cfg_yaml)
    assert cfg.trainer.experiment_name == run_id and cfg.trainer.total_training_steps == 2


def test_train_uses_experiment_name(monkeypatch):
    calls = _fake_flow(monkeypatch, "flows.pipeline", "pipeline")
    assert main(["train", "--config", TINY, "trainer.experiment_name=myrun"]) == 0
    assert calls[0][1] == "myrun"


def test_prepare_eval_deploy_dispatch(monkeypatch):
    monkeypatch.setenv("DAPO_SKIP_PREFLIGHT", "1")  # dispatch only: the checkpoint does not exist
    prep = _fake_flow(monkeypatch, "flows.prepare_data", "prepare_data_flow")
    ev = _fake_flow(monkeypatch, "flows.evaluate", "evaluate_flow")
    dep = _fake_flow(monkeypatch, "flows.deploy", "deploy")
    assert main(["prepare", "--config", TINY]) == 0 and len(prep) == 1
    assert main(["eval", "--config", TINY, "--checkpoint", "runs/x/ckpt/step_2"]) == 0
    assert (
        ev[0][1] == "runs/x/ckpt/step_2"
        and OmegaConf.create(ev[0][0]).eval.checkpoint == "runs/x/ckpt/step_2"
    )
    assert main(["deploy", "--config", TINY, "--name", "nightly"]) == 0 and dep[0][1] == "nightly"
    assert main(["deploy", "--config", TINY]) == 0 and dep[1][1] == "tiny-cpu"


def test_train_flow_only_runs_dapo_train(monkeypatch):
    monkeypatch.setenv("DAPO_SKIP_PREFLIGHT", "1")  # dispatch only: data/ and models/ may not exist here
    calls = _fake_flow(monkeypatch, "flows.dapo_train", "dapo_train")
    assert main(["train", "--flow-only", "--config", TINY, "trainer.experiment_name=again"]) == 0
    assert calls[0][1] == "again"


def test_default_config_is_tiny_cpu(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["config"]) == 0
    assert OmegaConf.create(capsys.readouterr().out).data.train_batch_size == 16


def test_make_run_id_format():
    a, b = make_run_id(), make_run_id()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", a) and a[:8] == b[:8]
