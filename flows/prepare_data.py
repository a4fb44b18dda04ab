"""dapo-prepare-data: write the training and validation parquet files (verl schema) and `data/stats.json`.

- CPU default (`data.synthetic.enable=true`): generate arithmetic problems, train and held-out disjoint.
- Real runs: read DAPO-Math-17k and AIME-2024 from `data.source_files.{train,val}` (local paths or URLs
  reachable from the machine), report duplicate counts, and drop duplicates only when `data.dedup=true` (the
  reference keeps them: DAPO-Math-17k holds ~100 copies of each problem).
Every written table is validated with the dataset schema before it is written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import flow, get_run_logger, task

from dapo_core.config import load_config_text, typed
from dapo_core.data.dataset_checks import validate_dataset
from dapo_core.data.datasets import load_dapo_math, make_synthetic_splits, read_parquet, write_parquet
from dapo_core.data.word_problems import make_word_problem_splits
from flows.progress import say


@task(name="synthetic_data")
def synthetic_data(cfg_yaml: str) -> dict:
    """Generate the synthetic train/val splits."""
    syn = typed(load_config_text(cfg_yaml)).data.synthetic
    make_splits = make_word_problem_splits if syn.kind == "word" else make_synthetic_splits
    train, val = make_splits(
        syn.num_train,
        syn.num_val,
        seed=syn.seed,
        min_value=syn.min_value,
        max_value=syn.max_value,
        num_operands=syn.num_operands,
        ops=syn.ops,
    )
    out = Path(syn.out_dir)
    stats = {}
    for name, rows in (("train", train), ("val", val)):
        path = out / f"{name}.parquet"
        write_parquet(rows, path)
        table = read_parquet(path)
        validate_dataset(table, name=str(path))
        stats[name] = {"path": str(path), "rows": table.num_rows, "unique": table.num_rows, "duplicates": 0}
    return stats


@task(name="dapo_data")
def dapo_data(cfg_yaml: str) -> dict:
    """Read DAPO-Math-17k / AIME-2024 from the configured sources, count (and optionally drop) duplicates."""
    cfg = typed(load_config_text(cfg_yaml))
    out = Path(cfg.data.synthetic.out_dir)
    stats = {}
    for name, src in (("train", cfg.data.source_files.train), ("val", cfg.data.source_files.val)):
        if not src:
            continue
        t0 = time.perf_counter()
        say(f"prepare: reading the {name} split from {src} (a URL is downloaded first: minutes for 17k rows)")
        table, st = load_dapo_math([src], dedup=cfg.data.dedup)
        say(
            f"prepare: {name}: {st['rows']} rows read in {time.perf_counter() - t0:.0f}s; validating, writing"
        )
        validate_dataset(table, name=src)
        path = out / f"{'dapo-math-17k' if name == 'train' else 'aime-2024'}.parquet"
        write_parquet(table, path)
        stats[name] = {"path": str(path), "source": src, **st}
    return stats


@flow(name="dapo-prepare-data", log_prints=True)
def prepare_data_flow(cfg_yaml: str) -> dict:
    """Write the datasets named by the config and `stats.json` beside them; returns the stats."""
    cfg = typed(load_config_text(cfg_yaml))
    logger = get_run_logger()
    stats = synthetic_data(cfg_yaml) if cfg.data.synthetic.enable else dapo_data(cfg_yaml)
    out = Path(cfg.data.synthetic.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stats.json").write_text(json.dumps(stats, indent=1, sort_keys=True))
    for split, st in stats.items():
        logger.info(
            "%s: %s rows (%s unique, %s duplicates) -> %s",
            split,
            st.get("rows"),
            st.get("unique"),
            st.get("duplicates"),
            st.get("path"),
        )
    return stats
