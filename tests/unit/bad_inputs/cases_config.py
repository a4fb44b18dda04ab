"""Rows of the bad-input table: config files and overrides, keys accepted but not read."""

from __future__ import annotations

from tests.unit.bad_inputs.workspace import (
    Case,
    _base_cycle,
    _config,
    _train,
    _with_file,
)

CONFIG: list[Case] = [
    # --- config files and overrides
    Case(
        "empty config file",
        "config",
        _with_file("empty.yaml", ""),
        ("empty.yaml", "is empty", "configs/"),
        "ConfigError",
    ),
    Case(
        "comments-only config file",
        "config",
        _with_file("c.yaml", "# nothing\n\n"),
        ("c.yaml", "is empty"),
        "ConfigError",
    ),
    Case(
        "malformed YAML",
        "config",
        _with_file("m.yaml", "data:\n  train_batch_size: [1,\n"),
        ("m.yaml", "line 3", "fix the YAML"),
        "ConfigError",
    ),
    Case(
        "bad indentation",
        "config",
        _with_file("i.yaml", "data:\n  seed: 1\n   max: 2\n  x: [\n"),
        ("i.yaml", "line", "fix the YAML"),
        "ConfigError",
    ),
    Case(
        "random bytes as config",
        "config",
        _with_file("r.yaml", bytes(range(128, 256)) * 3),
        ("r.yaml", "not UTF-8", "--config"),
        "ConfigError",
    ),
    Case(
        "config is a list", "config", _with_file("l.yaml", "- a\n- b\n"), ("l.yaml", "mapping"), "ConfigError"
    ),
    Case(
        "config file missing",
        "config",
        lambda ws: ["train", "--config", str(ws.root / "nope.yaml")],
        ("nope.yaml", "does not exist", "--config"),
        "ConfigError",
    ),
    Case(
        "config path is a folder",
        "config",
        lambda ws: ["train", "--config", str(ws.root)],
        ("does not exist", "--config"),
        "ConfigError",
    ),
    Case(
        "base: cycle",
        "config",
        lambda ws: ["config", "--config", str(ws.root / "a.yaml")],
        ("cycle", "a.yaml"),
        "ConfigError",
        setup=_base_cycle,
    ),
    Case(
        "base: file missing",
        "config",
        _with_file("b.yaml", "base: gone.yaml\n"),
        ("gone.yaml", "does not exist"),
        "ConfigError",
    ),
    Case(
        "unknown key",
        "config",
        _config("actor_rollout_ref.actor.clip_ratio_hgh=0.3"),
        ("clip_ratio_hgh", "did you mean clip_ratio_high"),
        "ConfigError",
    ),
    Case(
        "wrong type",
        "config",
        _config("data.train_batch_size=abc"),
        ("data.train_batch_size", "type"),
        "ConfigError",
    ),
    Case("override without =", "config", _config("data.seed"), ("data.seed", "key=value"), "ConfigError"),
    Case(
        "override deleting a key", "config", _config("~data.seed"), ("~data.seed", "key=value"), "ConfigError"
    ),
    Case(
        "unset env interpolation",
        "config",
        _config("trainer.runs_dir=${oc.env:DAPO_NOT_SET_XYZ}"),
        ("trainer.runs_dir", "environment variable"),
        "ConfigError",
    ),
    Case(
        "reward timeout 0",
        "config",
        _config("reward_model.timeout_s=0"),
        ("reward_model.timeout_s", "> 0"),
        "ConfigError",
    ),
    Case(
        "reward timeout negative",
        "config",
        _config("reward_model.timeout_s=-5"),
        ("reward_model.timeout_s", "> 0"),
        "ConfigError",
    ),
    Case(
        "reward timeout NaN",
        "config",
        _config("reward_model.timeout_s=.nan"),
        ("reward_model.timeout_s", "finite"),
        "ConfigError",
    ),
    Case(
        "failure rate above 1",
        "config",
        _config("reward_model.max_failure_rate=1.5"),
        ("reward_model.max_failure_rate", "[0, 1]"),
        "ConfigError",
    ),
    Case(
        "gpu_memory_utilization 0",
        "config",
        _config("actor_rollout_ref.rollout.gpu_memory_utilization=0"),
        ("gpu_memory_utilization", "(0, 1]"),
        "ConfigError",
    ),
    Case(
        "train_batch_size 0",
        "config",
        _config("data.train_batch_size=0"),
        ("data.train_batch_size", ">= 1"),
        "ConfigError",
    ),
    Case(
        "resume_mode unknown",
        "config",
        _config("trainer.resume_mode=sometimes"),
        ("trainer.resume_mode", "auto"),
        "ConfigError",
    ),
    Case(
        "data.prompt_key set",
        "unused key",
        _config("data.prompt_key=question"),
        ("data.prompt_key", "not implemented", "remove the key"),
        "ConfigError",
    ),
    Case(
        "data.reward_fn_key set",
        "unused key",
        _config("data.reward_fn_key=src"),
        ("data.reward_fn_key", "not implemented"),
        "ConfigError",
    ),
    Case(
        "reward_manager set",
        "unused key",
        _config("reward_model.reward_manager=naive"),
        ("reward_model.reward_manager", "not implemented"),
        "ConfigError",
    ),
    Case(
        "nnodes 2 with a one-process engine",
        "config",
        _config("trainer.nnodes=2"),
        ("trainer.nnodes", "strategy=fsdp2"),
        "ConfigError",
    ),
    Case(
        "val_batch_size set (no-op)",
        "unused key",
        _train("data.val_batch_size=8"),
        ("data.val_batch_size", "no effect"),
        code=0,
        error="",
    ),
    Case(
        "rollout TP does not divide the devices",
        "config",
        _config("trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
        ("tensor_model_parallel_size", "does not divide", "trainer.n_gpus_per_node"),
        "ConfigError",
    ),
]
