"""A run's inputs: the base model's path, the train and held-out tables, the prompt sampler, and the
fingerprints of data, model and training config that a resume checks against `inputs.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
from omegaconf import OmegaConf

from dapo_core.config import (
    DapoConfig,
    DataConfig,
    to_safe_yaml,
)
from dapo_core.data.datasets import PromptSampler, read_parquet
from dapo_core.data.sampler import HistorySampler
from dapo_core.store import RunStore
from dapo_core.store.fingerprints import (
    InputsChanged,
    changes,
    config_fingerprint,
    data_fingerprint,
    folder_fingerprint,
)


def default_model_path(cfg: DapoConfig) -> str:
    """`actor_rollout_ref.model.path`, or the embedded tiny base model built by the base-model flow."""
    return cfg.actor_rollout_ref.model.path or str(Path(cfg.trainer.models_dir) / "tiny_base")


def read_table(files: list[str]) -> pa.Table:
    """Concatenate one or several verl parquet files (paths or URLs)."""
    tables = [read_parquet(f) for f in files]
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]


def val_prompts(data: DataConfig, tokenizer: Any, files: list[str] | None = None) -> pa.Table:
    """All validation prompts of `files` (default `data.val_files`), tokenised, in file order."""
    table = read_table(files or data.val_files)
    sampler = PromptSampler(
        table,
        tokenizer,
        batch_size=table.num_rows,
        shuffle=False,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
    )
    return sampler.next_batch()


INPUTS_FILE = "inputs.json"
"""The run's record of its inputs' fingerprints (`dapo_core.store.fingerprints`)."""


def input_fingerprints(
    cfg: DapoConfig, model_path: str, tokenizer_path: str, train: pa.Table, val: pa.Table, known: dict | None
) -> dict:
    """The fingerprints of this attempt's inputs: data files and rows, base model and tokenizer folders,
    training-relevant config keys (files whose size and mtime match `known` are not re-hashed)."""
    known = known or {}
    out = {
        "format": 1,
        "data": {
            "train": data_fingerprint(cfg.data.train_files, train, known.get("data", {}).get("train")),
            "val": data_fingerprint(cfg.data.val_files, val, known.get("data", {}).get("val")),
        },
        "model": folder_fingerprint(model_path, known.get("model")),
        "config": config_fingerprint(OmegaConf.to_container(OmegaConf.structured(cfg))),  # type: ignore[arg-type]
    }
    if Path(tokenizer_path).resolve() != Path(model_path).resolve():
        out["tokenizer"] = folder_fingerprint(tokenizer_path, known.get("tokenizer"))
    return out


def default_config_fingerprint() -> dict[str, str]:
    """`config_fingerprint` of the schema's defaults (`DapoConfig()`)."""
    return config_fingerprint(OmegaConf.to_container(OmegaConf.structured(DapoConfig())))  # type: ignore[arg-type]


def check_inputs(store: RunStore, cfg: DapoConfig, inputs: dict) -> list[str]:
    """Compare this attempt's inputs with the run's record: [] when equal or when the run is new; the
    changes when `trainer.allow_changed_inputs` (after a warning); else :class:`InputsChanged` naming them."""
    old = store.read_json(INPUTS_FILE, default=None)
    if old is None:
        if store.steps() or store.checkpoints.steps():
            print(
                f"warning: {store.root} has no {INPUTS_FILE} (a run started by an older version): this "
                f"attempt's inputs are recorded now; changes made before it cannot be detected"
            )
        return []
    diff = changes(old, inputs, defaults=default_config_fingerprint())
    if not diff:
        return []
    listed = "; ".join(diff)
    if not cfg.trainer.allow_changed_inputs:
        raise InputsChanged(
            f"run {store.root.name} was started with other inputs than this attempt uses: {listed}",
            where=str(store.root / INPUTS_FILE),
            fix=(
                "resume with the run's original data, base model and config; or start a new run (a new "
                "trainer.experiment_name); or, to continue this run with the new inputs on purpose, set "
                "trainer.allow_changed_inputs=true (stored rollouts of later steps are then discarded)"
            ),
        )
    print(
        f"warning: continuing run {store.root.name} with changed inputs (trainer.allow_changed_inputs=true): "
        f"{listed}. Rollouts stored for steps after the checkpoint are discarded and regenerated"
    )
    return diff


def config_record(cfg: DapoConfig) -> str:
    """The config as written to the run folder: resolved, secrets written back as `${oc.env:NAME}`
    (`to_safe_yaml`)."""
    return to_safe_yaml(OmegaConf.structured(cfg))


def train_sampler(cfg: DapoConfig, table: pa.Table, tokenizer: Any) -> PromptSampler:
    """The training prompts' sampler, one prompt per draw: verl's seeded epochs (`PromptSampler`), or with
    `data.history_sampler.enable` the `HistorySampler` that passes over prompts whose recent groups had no
    reward spread. The latter is for the sync step order: in the replay order rewards arrive after later
    draws, in an order a resumed run could not replay exactly, so there the switch is ignored (one line says
    so) and verl's sampler draws."""
    opts: dict[str, Any] = {
        "batch_size": 1,
        "seed": cfg.data.seed,
        "shuffle": cfg.data.shuffle,
        "max_prompt_length": cfg.data.max_prompt_length,
        "truncation": cfg.data.truncation,
    }
    hs = cfg.data.history_sampler
    if not hs.enable:
        return PromptSampler(table, tokenizer, **opts)
    if cfg.trainer.step_order != "sync":
        print(
            f"data.history_sampler: not used with trainer.step_order={cfg.trainer.step_order} (sync order "
            "only); verl's sampler draws the prompts"
        )
        return PromptSampler(table, tokenizer, **opts)
    return HistorySampler(table, tokenizer, window=hs.window, explore_prob=hs.explore_prob, **opts)
