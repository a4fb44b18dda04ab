"""Validation / evaluation summaries of a scored table: mean@k, std@k, best@k, maj@k (reference §7.4) and pass@k,
per data source, with the reference's `val-core/…` / `val-aux/…` key names."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa

from dapo_core.metrics.step import pass_at_k, process_validation_metrics, val_metrics_to_keys


def validation_summary(table: pa.Table, *, seed: int = 42) -> dict[str, float]:
    """Flat metric dict for a scored table with columns uid, data_source, acc, reward, pred (k rows per uid)."""
    sources = table.column("data_source").to_pylist()
    uids = table.column("uid").to_pylist()
    infos = {
        "acc": [float(bool(a)) for a in table.column("acc").to_pylist()],
        "reward": [float(r) for r in table.column("reward").to_pylist()],
        "pred": [p if p is not None else "" for p in table.column("pred").to_pylist()],
    }
    nested = process_validation_metrics(sources, uids, infos, seed=seed)
    out = dict(val_metrics_to_keys(nested))
    out.update(pass_at_k_by_source(sources, uids, infos["acc"]))
    out.update(answer_line_rate_by_source(sources, table.column("pred").to_pylist()))
    return out


def answer_line_rate_by_source(sources, preds) -> dict[str, float]:
    """`val-aux/<source>/format/answer_line_rate`: share of responses with a parseable final answer (pred not
    `[INVALID]`) — separates "forgot the Answer: line" from "wrong number" when reading accuracy curves."""
    by: dict[str, list[float]] = defaultdict(list)
    for s, p in zip(sources, preds):
        by[s].append(0.0 if p in (None, "[INVALID]") else 1.0)
    return {f"val-aux/{s}/format/answer_line_rate": float(np.mean(v)) for s, v in by.items()}


def pass_at_k_by_source(sources, uids, acc) -> dict[str, float]:
    """`val-core/<source>/acc/pass@k` for k = 1, 2, 4, … ≤ n (unbiased estimator, averaged over prompts)."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s, u, a in zip(sources, uids, acc):
        groups[(s, u)].append(a)
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for (s, _), vals in groups.items():
        by_source[s].append(vals)
    out = {}
    for s, groups_s in by_source.items():
        n = min(len(g) for g in groups_s)
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n} | {n})
        for k in ks:
            out[f"val-core/{s}/acc/pass@{k}"] = float(
                np.mean([pass_at_k(len(g), int(sum(g)), k) for g in groups_s])
            )
    return out
