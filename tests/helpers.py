"""Small shared test data: the tiny model shapes the tests build (fast on one CPU thread)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SMALL_MODEL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,  # vLLM's CPU attention needs head_dim >= 32
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"""`actor_rollout_ref.model.tiny` keys of a two-layer model with 64 hidden units."""


def tiny_model_cfg(**overrides: Any) -> dict[str, Any]:
    """`SMALL_MODEL` with some keys replaced (e.g. `hidden_size=32` for the fastest tests)."""
    unknown = set(overrides) - set(SMALL_MODEL)
    if unknown:
        raise KeyError(f"not a tiny-model key: {sorted(unknown)}")
    return {**SMALL_MODEL, **overrides}


def in_process_run_overrides(tmp_path: Path, num_train: int = 32, num_val: int = 4) -> list[str]:
    """Write `num_train` / `num_val` synthetic problems and build a one-layer random tiny model under
    `tmp_path`; returns the overrides that point the CPU default at them with in-process workers (a run opened
    with `flows.run_setup.open_run` in the test's process; add `trainer.runs_dir`)."""
    from dapo_core.compute.models import build_tiny_model
    from dapo_core.data.datasets import make_synthetic_splits, write_parquet

    train, val = make_synthetic_splits(
        num_train, num_val, seed=0, min_value=0, max_value=99, num_operands=2, ops=["+"]
    )
    write_parquet(train, tmp_path / "train.parquet")
    write_parquet(val, tmp_path / "val.parquet")
    model = build_tiny_model(tmp_path / "model", tiny_model_cfg(num_hidden_layers=1), seed=0)
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'val.parquet'}]",
        "trainer.use_ray=false",
        "trainer.logger=[jsonl]",
        "reward_model.num_workers=1",
    ]


def write_good_inputs(root: Path) -> Path:
    """Good inputs in `root`: train.parquet and val.parquet (24 and 8 synthetic problems) and a tiny model
    folder `model/` with the schema's default shape; returns `root`."""
    from dataclasses import asdict

    from dapo_core.compute.models import build_tiny_model
    from dapo_core.config.schema import TinyModelConfig
    from dapo_core.data.datasets import make_synthetic_splits, write_parquet

    train, val = make_synthetic_splits(24, 8, seed=0)
    write_parquet(train, root / "train.parquet")
    write_parquet(val, root / "val.parquet")
    build_tiny_model(root / "model", asdict(TinyModelConfig()), 0)
    return root
