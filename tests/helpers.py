"""Small shared test helpers: the tiny model shapes the tests build (fast on one CPU thread), their inputs,
and `wait_for`, the one way a test waits for something to happen."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    what: str,
    timeout_s: float,
    poll_s: float = 0.05,
    *,
    alive: subprocess.Popen | None = None,
) -> T:
    """Call `predicate` every `poll_s` seconds until it returns something truthy, and return that. Fail with
    an AssertionError naming `what` when `timeout_s` passes first, or, with `alive`, as soon as that process
    exits (with its exit code). The deadline is generous on purpose: a busy machine only makes it slower."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"waiting for {what}: the process {alive.pid} exited ({alive.returncode})")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def unchanged_for(paths: list[Path], after_s: float) -> bool:
    """Whether every file of `paths` has been unchanged (mtime and ctime) for `after_s` seconds now: settled
    in the sense of the run store's trust records (`dapo_core.store.trust.settled`)."""
    now = time.time_ns()
    return all(now - max(st.st_mtime_ns, st.st_ctime_ns) >= after_s * 1e9 for st in (p.stat() for p in paths))


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
