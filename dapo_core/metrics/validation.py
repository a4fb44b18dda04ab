"""Validation / evaluation metrics of a scored table, per data source, with the reference's `val-core/…` /
`val-aux/…` key names (docs/REFERENCE.md §7.4): mean@k, std@k, best@k / worst@k and maj@k (bootstrap,
`process_validation_metrics`), pass@k (`pass_at_k_by_source`) and the answer-line rate.
`validation_summary` is what the validate task and `dapo eval` log."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "answer_line_rate_by_source",
    "bootstrap_metric",
    "calc_maj_val",
    "pass_at_k",
    "pass_at_k_by_source",
    "process_validation_metrics",
    "val_metrics_to_keys",
    "validation_summary",
]


def validation_summary(table: pa.Table, *, seed: int = 42) -> dict[str, float]:
    """Flat metric dict for a scored table with columns uid, data_source, acc, reward, pred (k rows per
    uid)."""
    sources = table.column("data_source").to_pylist()
    uids = table.column("uid").to_pylist()
    infos: dict[str, list[Any]] = {
        "acc": [float(bool(a)) for a in table.column("acc").to_pylist()],
        "reward": [float(r) for r in table.column("reward").to_pylist()],
        "pred": [p if p is not None else "" for p in table.column("pred").to_pylist()],
    }
    nested = process_validation_metrics(sources, uids, infos, seed=seed)
    out = dict(val_metrics_to_keys(nested))
    out.update(pass_at_k_by_source(sources, uids, infos["acc"]))
    out.update(answer_line_rate_by_source(sources, table.column("pred").to_pylist()))
    return out


def answer_line_rate_by_source(sources: Sequence[str], preds: Sequence[str | None]) -> dict[str, float]:
    """`val-aux/<source>/format/answer_line_rate`: share of responses with a parseable final answer (pred not
    `[INVALID]`) — separates "forgot the Answer: line" from "wrong number" when reading accuracy curves."""
    by: dict[str, list[float]] = defaultdict(list)
    for s, p in zip(sources, preds, strict=True):
        by[s].append(0.0 if p in (None, "[INVALID]") else 1.0)
    return {f"val-aux/{s}/format/answer_line_rate": float(np.mean(v)) for s, v in by.items()}


def pass_at_k_by_source(
    sources: Sequence[str], uids: Sequence[str], acc: Sequence[float]
) -> dict[str, float]:
    """`val-core/<source>/acc/pass@k` for k = 1, 2, 4, … ≤ n (unbiased estimator, averaged over prompts)."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s, u, a in zip(sources, uids, acc, strict=True):
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


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[[np.ndarray], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """(mean, population std) of each ``reduce_fn`` over ``n_bootstrap`` resamples (with replacement)
    of ``subset_size`` items. Index draws equal the reference's ``np.random.seed(seed)`` +
    ``np.random.choice`` stream (a private ``RandomState``; the global NumPy RNG is untouched)."""
    rs = np.random.RandomState(seed)
    arr = np.empty(len(data), dtype=object)
    arr[:] = list(data)
    idx = rs.choice(len(arr), size=(n_bootstrap, subset_size), replace=True)
    out = []
    for fn in reduce_fns:
        vals = np.fromiter((fn(arr[row]) for row in idx), dtype=np.float64, count=n_bootstrap)
        out.append((float(np.mean(vals)), float(np.std(vals))))
    return out


def calc_maj_val(data: Iterable[Mapping[str, Any]], vote_key: str, val_key: str) -> float:
    """Majority vote on ``vote_key``; returns ``val_key`` of the first item with the winning vote
    (ties: the vote seen first wins)."""
    counts: Counter = Counter()
    first: dict[Any, Any] = {}
    for d in data:
        v = d[vote_key]
        counts[v] += 1
        first.setdefault(v, d[val_key])
    winner = max(counts, key=lambda v: counts[v])  # max() keeps the first maximal key in insertion order
    return first[winner]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator ``1 − C(n−c, k)/C(n, k)`` for ``c`` correct out of ``n`` samples."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass_at_k: need 0 ≤ c ≤ n and 1 ≤ k ≤ n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _ns(n: int) -> list[int]:
    if n <= 1:
        return []
    out, m = [], 2
    while m < n:
        out.append(m)
        m *= 2
    return [*out, n]


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[str],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
) -> dict[str, dict[str, dict[str, float]]]:
    """``{data_source: {var: {metric: value}}}`` averaged over prompt groups (§7.4).

    Groups rows by (data_source, uid). Per numeric variable (strings skipped): ``mean@n``; if n > 1
    ``std@n`` (population) and for N in {2, 4, …, < n} ∪ {n}: ``best@N/{mean,std}``,
    ``worst@N/{mean,std}`` (bootstrap, 1000 resamples, ``seed``) and ``maj@N/{mean,std}`` when a
    ``pred`` variable exists. pass@k is :func:`pass_at_k_by_source`.
    """
    grouped: dict[str, dict[str, dict[str, list]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for i, ds in enumerate(data_sources):
        var2vals = grouped[ds][sample_uids[i]]
        for var, vals in infos_dict.items():
            var2vals[var].append(vals[i])

    per_ds: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for ds, uid2vars in grouped.items():
        for var2vals in uid2vars.values():
            preds = var2vals.get("pred")
            for var, vals in var2vals.items():
                if not vals or isinstance(vals[0], str):
                    continue
                n = len(vals)
                m: dict[str, float] = {f"mean@{n}": float(np.mean(vals))}
                if n > 1:
                    m[f"std@{n}"] = float(np.std(vals))
                    for N in _ns(n):
                        (bm, bs), (wm, ws) = bootstrap_metric(vals, N, [np.max, np.min], seed=seed)
                        m[f"best@{N}/mean"], m[f"best@{N}/std"] = bm, bs
                        m[f"worst@{N}/mean"], m[f"worst@{N}/std"] = wm, ws
                        if preds is not None:
                            votes = [{"val": v, "pred": p} for v, p in zip(vals, preds, strict=True)]
                            [(mm, ms)] = bootstrap_metric(
                                votes,
                                N,
                                [lambda d: calc_maj_val(d, vote_key="pred", val_key="val")],
                                seed=seed,
                            )
                            m[f"maj@{N}/mean"], m[f"maj@{N}/std"] = mm, ms
                for k, v in m.items():
                    per_ds[ds][var][k].append(v)
    return {
        ds: {var: {k: float(np.mean(v)) for k, v in mets.items()} for var, mets in vars_.items()}
        for ds, vars_ in per_ds.items()
    }


def val_metrics_to_keys(nested: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, float]:
    """Flatten :func:`process_validation_metrics` output to logger keys.

    ``val-core/{ds}/{var}/{metric}`` when ``var`` is the core variable (``acc`` if present else
    ``reward``), the metric starts with mean/maj/best and is at the largest N; else ``val-aux/…``.
    """
    out: dict[str, float] = {}
    for ds, var2metric in nested.items():
        core = "acc" if "acc" in var2metric else "reward"
        for var, metrics in var2metric.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metrics)
            for name, val in metrics.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                out[f"{'val-core' if is_core else 'val-aux'}/{ds}/{var}/{name}"] = val
    return out
