"""Training and validation metrics with the reference (verl NEWEST) key names.

- :func:`compute_data_metrics` — ``critic/*``, ``response_length*``, ``prompt_length/*`` (§7.1, incl.
  the aborted / non-aborted split: a row with an empty response is *aborted*).
- :func:`compute_timing_metrics`, :func:`compute_throughput_metrics` (alias
  :func:`compute_throughout_metrics`, the reference's spelling) (§7.2).
- :func:`compute_variance_proxy_metrics` (§7.3).
- :func:`process_validation_metrics`, :func:`bootstrap_metric`, :func:`calc_maj_val`,
  :func:`val_metrics_to_keys`, :func:`pass_at_k` (§7.4).
- :class:`MoELoadBalanceAccumulator`, :func:`compute_moe_lb_metrics` (§7.5);
  :func:`compute_spec_decode_metrics` (§7.6); :func:`compute_staleness_metrics`,
  :func:`compute_eviction_metrics` (§7.7).
- :func:`reduce_metrics`, :class:`Metric`, :func:`append_to_dict`, :func:`log_seqlen_unbalance`.

Batches may be given as a dict of padded tensors (keys as in ``dapo_core.data.batch.to_padded`` plus
``token_level_scores``/``token_level_rewards``/``advantages``/``returns``/``values``) or as the Arrow
table of the batch contract, which is padded here.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np
import pyarrow as pa
import torch

__all__ = [
    "AggregationType",
    "Metric",
    "MoELoadBalanceAccumulator",
    "append_to_dict",
    "bootstrap_metric",
    "calc_maj_val",
    "compute_data_metrics",
    "compute_eviction_metrics",
    "compute_moe_lb_metrics",
    "compute_spec_decode_metrics",
    "compute_staleness_metrics",
    "compute_throughout_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "compute_variance_proxy_metrics",
    "count_routed_experts",
    "log_seqlen_unbalance",
    "pass_at_k",
    "process_validation_metrics",
    "reduce_metrics",
    "val_metrics_to_keys",
]

_NAN = float("nan")


# --------------------------------------------------------------------------------------------------
# batch access


def _tensor_batch(
    batch: Mapping[str, Any] | pa.Table, wanted: Sequence[str], **pad_kw: Any
) -> dict[str, Any]:
    """Dict of tensors from a dict batch (returned as is) or an Arrow table (padded here)."""
    if not isinstance(batch, pa.Table):
        return dict(batch)
    from dapo_core.data.batch import to_padded

    cols = [c for c in wanted if c in batch.column_names]
    out: dict[str, Any] = to_padded(batch, 0, columns=cols, **pad_kw)
    L = out["responses"].shape[1]
    if "reward" in batch.column_names:
        # Σ token_level_scores = the scalar reward placed at the last valid token (score + overlong).
        reward = torch.tensor(
            np.array(batch.column("reward").to_numpy(zero_copy_only=False)), dtype=torch.float32
        )
        scores = torch.zeros(batch.num_rows, L)
        idx = (out["response_length"] - 1).clamp(min=0)
        if L:
            scores[torch.arange(batch.num_rows), idx] = reward
        out["token_level_scores"] = scores
        if "token_level_rewards" not in out:
            out["token_level_rewards"] = scores
    return out


def _lengths(b: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(prompt_length, response_length, max_prompt_length, max_response_length) as float tensors."""
    L = b["responses"].shape[-1]
    P = b["prompts"].shape[-1] if "prompts" in b else None
    if "response_length" in b and "prompt_length" in b:
        rl = torch.as_tensor(b["response_length"]).float()
        pl = torch.as_tensor(b["prompt_length"]).float()
    else:
        am = b["attention_mask"]
        pl = am[:, :-L].sum(-1).float() if L else am.sum(-1).float()
        rl = am[:, -L:].sum(-1).float() if L else torch.zeros(am.shape[0])
    if P is None:
        P = int(b["attention_mask"].shape[-1] - L)
    return pl, rl, int(P), int(L)


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {f"{prefix}/mean": _NAN, f"{prefix}/max": _NAN, f"{prefix}/min": _NAN}
    x = x.float()
    return {
        f"{prefix}/mean": x.mean().item(),
        f"{prefix}/max": x.max().item(),
        f"{prefix}/min": x.min().item(),
    }


# --------------------------------------------------------------------------------------------------
# §7.1 data metrics


def compute_data_metrics(
    batch: Mapping[str, Any] | pa.Table,
    use_critic: bool = True,
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> dict[str, float]:
    """Batch statistics with the reference keys (NEWEST §7.1).

    ``critic/score|rewards/{mean,max,min}`` over per-sequence sums of ``token_level_scores`` /
    ``token_level_rewards`` of non-aborted rows (NaN if all are aborted); ``critic/advantages|returns``
    over valid tokens (``response_mask``); with ``use_critic`` also ``critic/values/*`` and
    ``critic/vf_explained_var = 1 − var(R−V)/(var(R)+1e-5)`` (unbiased var); ``response_length/*``,
    ``response_length_non_aborted/*`` (with ``clip_ratio`` = fraction at the padded width),
    ``response/aborted_ratio`` and ``prompt_length/*``. For an Arrow table pass the configured
    ``max_*_length`` so the clip ratios refer to them (default: the longest row).
    """
    wanted = ["advantages", "returns", "token_level_rewards"] + (["values"] if use_critic else [])
    b = _tensor_batch(
        batch, wanted, max_prompt_length=max_prompt_length, max_response_length=max_response_length
    )
    pl, rl, P, L = _lengths(b)
    mask = b["response_mask"].bool()
    non_aborted = rl > 0

    metrics: dict[str, float] = {}
    seq_score = b["token_level_scores"].sum(-1)[non_aborted]
    seq_reward = b["token_level_rewards"].sum(-1)[non_aborted]
    metrics.update(_stats("critic/score", seq_score))
    metrics.update(_stats("critic/rewards", seq_reward))
    valid_adv = torch.masked_select(b["advantages"], mask)
    valid_ret = torch.masked_select(b["returns"], mask)
    metrics.update(_stats("critic/advantages", valid_adv))
    metrics.update(_stats("critic/returns", valid_ret))
    if use_critic:
        valid_val = torch.masked_select(b["values"], mask)
        metrics.update(_stats("critic/values", valid_val))
        if valid_ret.numel() > 1:
            ret_var = torch.var(valid_ret.float())
            metrics["critic/vf_explained_var"] = (
                1.0 - torch.var((valid_ret - valid_val).float()) / (ret_var + 1e-5)
            ).item()
        else:
            metrics["critic/vf_explained_var"] = _NAN

    def _len_stats(prefix: str, x: torch.Tensor, width: int) -> dict[str, float]:
        out = _stats(prefix, x)
        out[f"{prefix}/clip_ratio"] = torch.eq(x, width).float().mean().item() if x.numel() else _NAN
        return out

    metrics.update(_len_stats("response_length", rl, L))
    metrics.update(_len_stats("response_length_non_aborted", rl[non_aborted], L))
    metrics["response/aborted_ratio"] = (~non_aborted).float().mean().item() if rl.numel() else _NAN
    metrics.update(_len_stats("prompt_length", pl, P))
    for key, name in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts")):
        if key in b:
            x = torch.as_tensor(np.asarray(b[key], dtype=np.float64))
            s = _stats(name, x)
            metrics.update(
                {
                    f"{name}/min": s[f"{name}/min"],
                    f"{name}/max": s[f"{name}/max"],
                    f"{name}/mean": s[f"{name}/mean"],
                }
            )
    return metrics


# --------------------------------------------------------------------------------------------------
# §7.2 timing and throughput


def _token_counts(batch: Mapping[str, Any] | pa.Table) -> tuple[int, int]:
    """(response tokens, prompt+response tokens) of a batch."""
    if isinstance(batch, pa.Table):
        from dapo_core.data.batch import prompt_lengths, response_lengths

        r = int(response_lengths(batch).sum())
        return r, r + int(prompt_lengths(batch).sum())
    pl, rl, _, _ = _lengths(batch)
    r = int(rl.sum().item())
    return r, r + int(pl.sum().item())


_ALL_TOKEN_SECTIONS = ("ref", "values", "adv", "update_critic", "update_actor")


def compute_timing_metrics(
    batch: Mapping[str, Any] | pa.Table, timing_raw: Mapping[str, float]
) -> dict[str, float]:
    """``timing_s/{name}`` for every timer and ``timing_per_token_ms/{name}`` for ``gen`` (per response
    token) and ``ref, values, adv, update_critic, update_actor`` (per prompt+response token); 0.0 when
    the batch has no such tokens."""
    n_resp, n_all = _token_counts(batch)
    tokens = {"gen": n_resp, **{name: n_all for name in _ALL_TOKEN_SECTIONS}}
    out = {f"timing_s/{name}": float(v) for name, v in timing_raw.items()}
    for name, v in timing_raw.items():
        if name in tokens:
            out[f"timing_per_token_ms/{name}"] = float(v) * 1000.0 / tokens[name] if tokens[name] else 0.0
    return out


def compute_throughput_metrics(
    batch: Mapping[str, Any] | pa.Table, timing_raw: Mapping[str, float], n_gpus: int
) -> dict[str, float]:
    """``perf/total_num_tokens`` (Σ ``global_token_num``: per-row prompt+response tokens, or the
    batch's ``global_token_num`` entry), ``perf/time_per_step = timing_raw['step']`` and
    ``perf/throughput = total / (time · n_gpus)``."""
    if not isinstance(batch, pa.Table) and "global_token_num" in batch:
        total = int(np.sum(np.asarray(batch["global_token_num"])))
    elif (
        not isinstance(batch, pa.Table) and "meta_info" in batch and "global_token_num" in batch["meta_info"]
    ):
        total = int(np.sum(np.asarray(batch["meta_info"]["global_token_num"])))
    else:
        total = _token_counts(batch)[1]
    if "step" not in timing_raw:
        raise KeyError(
            "compute_throughput_metrics: timing_raw has no 'step' timer; time the whole step as 'step'"
        )
    t = float(timing_raw["step"])
    return {
        "perf/total_num_tokens": total,
        "perf/time_per_step": t,
        "perf/throughput": total / (t * n_gpus),
    }


compute_throughout_metrics = compute_throughput_metrics
"""The reference's spelling ("throughout"), kept for drop-in compatibility."""


# --------------------------------------------------------------------------------------------------
# §7.3 variance proxy


def _masked_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m.bool(), x, torch.zeros_like(x)).sum(-1)


def compute_variance_proxy_metrics(
    batch: Mapping[str, Any], gradient_norm: float | None = None
) -> dict[str, float]:
    """Gradient-variance proxies from the W-score ``W_i = Σ_t (1 − 2π_t + Σπ²_t)`` (§7.3).

    Needs ``sum_pi_squared``, ``old_log_probs``, ``advantages`` (else ``{}``) and ``response_mask``;
    uses ``rollout_is_weights`` when present. proxy1 = grad_norm², proxy2 = mean(Ā²·max(W,0)) (with IS:
    mean(ρ̄²·Ā²·W_orig)), proxy3 = max(0, (proxy2 − proxy1)/(B−1)); Ā, ρ̄ are per-row masked means.
    """
    if not all(k in batch for k in ("sum_pi_squared", "old_log_probs", "advantages")):
        return {}
    mask = batch["response_mask"].float()
    w = 1.0 - 2.0 * torch.exp(batch["old_log_probs"]) + batch["sum_pi_squared"]
    valid = mask.sum(-1) > 0
    proxy1 = gradient_norm**2 if gradient_norm is not None else None
    if not bool(valid.any()):
        return {
            "variance_proxy/proxy1_signal_strength": proxy1 if proxy1 is not None else 0.0,
            "variance_proxy/proxy2_total_power": 0.0,
            "variance_proxy/proxy3_pure_noise": 0.0,
            "variance_proxy/expected_a_squared": 0.0,
            "variance_proxy/expected_w": 0.0,
        }
    denom = mask.sum(-1) + 1e-8
    isw = batch.get("rollout_is_weights")
    if isw is not None:
        w = w * (isw.detach() ** 2)
    a_bar = (_masked_sum(batch["advantages"], mask) / denom)[valid]
    w_seq = _masked_sum(w, mask)[valid]
    if isw is not None:
        rho_bar = (_masked_sum(isw, mask) / denom)[valid]
        w_orig = _masked_sum(w / torch.clamp(isw.detach() ** 2, min=1e-10), mask)[valid].clamp(min=0.0)
        proxy2 = (rho_bar**2 * a_bar**2 * w_orig).mean()
    else:
        proxy2 = (a_bar**2 * w_seq.clamp(min=0.0)).mean()
    proxy3 = 0.0
    if proxy1 is not None and a_bar.shape[0] > 1:
        proxy3 = max(0.0, float((proxy2 - proxy1) / (a_bar.shape[0] - 1)))
    return {
        "variance_proxy/proxy1_signal_strength": proxy1 if proxy1 is not None else 0.0,
        "variance_proxy/proxy2_total_power": float(proxy2),
        "variance_proxy/proxy3_pure_noise": proxy3,
        "variance_proxy/expected_a_squared": float((a_bar**2).mean()),
        "variance_proxy/expected_w": float(w_seq.mean()),
    }


# --------------------------------------------------------------------------------------------------
# §7.4 validation metrics


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


def calc_maj_val(data: Sequence[Mapping[str, Any]], vote_key: str, val_key: str) -> float:
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
    return out + [n]


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[str],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    *,
    with_pass_at_k: bool = False,
) -> dict[str, dict[str, dict[str, float]]]:
    """``{data_source: {var: {metric: value}}}`` averaged over prompt groups (§7.4).

    Groups rows by (data_source, uid). Per numeric variable (strings skipped): ``mean@n``; if n > 1
    ``std@n`` (population) and for N in {2, 4, …, < n} ∪ {n}: ``best@N/{mean,std}``,
    ``worst@N/{mean,std}`` (bootstrap, 1000 resamples, ``seed``) and ``maj@N/{mean,std}`` when a
    ``pred`` variable exists. ``with_pass_at_k`` adds ``pass@N`` (unbiased) for ``acc``-like
    variables, counting values > 0 as correct.
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
                if with_pass_at_k and var == "acc":
                    c = int(sum(1 for v in vals if float(v) > 0))
                    for N in [1] + _ns(n):
                        m[f"pass@{N}"] = pass_at_k(n, c, N)
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


# --------------------------------------------------------------------------------------------------
# §7.5 MoE load balance


def count_routed_experts(
    routed_experts: torch.Tensor | np.ndarray, response_mask: torch.Tensor | np.ndarray, num_experts: int
) -> np.ndarray | None:
    """Per-layer expert counts ``(layers, num_experts)`` from ``routed_experts [B, seqlen, layers, topk]``.

    Uses the last ``L`` positions (``L = response_mask.shape[1]``), response tokens only, excluding each
    sequence's last valid token (it has no routing record). Returns None (with a warning) on bad
    shapes or expert ids outside ``[0, num_experts)``.
    """
    re = torch.as_tensor(
        np.asarray(routed_experts) if not torch.is_tensor(routed_experts) else routed_experts
    )
    mask = torch.as_tensor(np.asarray(response_mask) if not torch.is_tensor(response_mask) else response_mask)
    if re.dim() != 4 or mask.dim() != 2 or re.shape[0] != mask.shape[0] or re.shape[1] < mask.shape[1]:
        warnings.warn(
            f"MoE metrics skipped: routed_experts shape {tuple(re.shape)} does not fit "
            f"response_mask {tuple(mask.shape)}",
            stacklevel=2,
        )
        return None
    L = mask.shape[1]
    resp = re[:, -L:].long()
    valid = mask.bool().clone()
    lengths = valid.long().sum(-1)
    rows = torch.nonzero(lengths > 0).flatten()
    if rows.numel():
        last = torch.stack([torch.nonzero(valid[r]).flatten()[-1] for r in rows])
        valid[rows, last] = False
    sel = resp[valid]  # (tokens, layers, topk)
    if sel.numel() and (int(sel.min()) < 0 or int(sel.max()) >= num_experts):
        warnings.warn(f"MoE metrics skipped: expert ids outside [0, {num_experts})", stacklevel=2)
        return None
    layers = re.shape[2]
    counts = np.zeros((layers, num_experts), dtype=np.int64)
    for layer in range(layers):
        counts[layer] = torch.bincount(sel[:, layer].reshape(-1), minlength=num_experts).numpy()
    return counts


def compute_moe_lb_metrics(counts: np.ndarray, prefix: str = "rollout/moe") -> dict[str, float]:
    """Load-balance violation per layer from expert counts ``(layers, E)``: ``dev_e = p_e·E − 1``;
    ``max_vio``/``min_vio``/``avg_vio`` (mean |dev|) per layer and their max/avg over layers."""
    counts = np.asarray(counts, dtype=np.float64)
    layers, E = counts.shape
    out: dict[str, float] = {}
    per: dict[str, list[float]] = {"max_vio": [], "min_vio": [], "avg_vio": []}
    for i in range(layers):
        total = counts[i].sum()
        if total <= 0:
            continue
        dev = counts[i] / total * E - 1.0
        vals = {
            "max_vio": float(dev.max()),
            "min_vio": float(dev.min()),
            "avg_vio": float(np.abs(dev).mean()),
        }
        for k, v in vals.items():
            out[f"{prefix}/{k}/layer_{i}"] = v
            per[k].append(v)
    for k, vs in per.items():
        if vs:
            out[f"{prefix}/{k}/max"] = float(np.max(vs))
            out[f"{prefix}/{k}/avg"] = float(np.mean(vs))
    out[f"{prefix}/routed_experts_found"] = 1.0 if counts.sum() > 0 else 0.0
    out[f"{prefix}/routed_expert_assignments"] = float(counts.sum())
    return out


class MoELoadBalanceAccumulator:
    """Accumulates expert counts across steps; emits metrics every ``interval`` global steps."""

    def __init__(self, num_experts: int, interval: int = 1) -> None:
        """``interval ≤ 0`` disables emission."""
        self.num_experts = num_experts
        self.interval = interval
        self.counts: np.ndarray | None = None

    def update(
        self, routed_experts: torch.Tensor | np.ndarray, response_mask: torch.Tensor | np.ndarray
    ) -> None:
        """Add the counts of one batch (ignored with a warning if the inputs are invalid)."""
        c = count_routed_experts(routed_experts, response_mask, self.num_experts)
        if c is None:
            return
        if self.counts is None or self.counts.shape != c.shape:
            self.counts = c.copy()
        else:
            self.counts += c

    def maybe_emit(self, global_steps: int) -> dict[str, float]:
        """Metrics (and reset) when ``global_steps % interval == 0``; else ``{}``."""
        if self.interval <= 0 or global_steps % self.interval != 0 or self.counts is None:
            return {}
        out = compute_moe_lb_metrics(self.counts)
        self.counts = None
        return out


# --------------------------------------------------------------------------------------------------
# §7.6 speculative decoding


def compute_spec_decode_metrics(
    spec_drafts: Any = None, spec_accepts: Any = None, spec_verifies: Any = None, non_padding_mask: Any = None
) -> dict[str, float]:
    """``rollout/spec_accept_rate = mean(a/d)`` (0 where d = 0) and ``rollout/spec_accept_length =
    mean(1 + a/v)`` (0 where v = 0) over non-padding samples; all inputs None → ``{}``."""
    given = [x is not None for x in (spec_drafts, spec_accepts, spec_verifies)]
    if not any(given):
        return {}
    assert all(given), "spec_drafts, spec_accepts and spec_verifies must be given together"
    d = np.asarray(spec_drafts, dtype=np.float64).reshape(-1)
    a = np.asarray(spec_accepts, dtype=np.float64).reshape(-1)
    v = np.asarray(spec_verifies, dtype=np.float64).reshape(-1)
    if non_padding_mask is not None:
        keep = np.asarray(non_padding_mask, dtype=bool).reshape(-1)
        d, a, v = d[keep], a[keep], v[keep]
    if d.size == 0:
        return {"rollout/spec_accept_rate": 0.0, "rollout/spec_accept_length": 0.0}
    rate = np.divide(a, d, out=np.zeros_like(a), where=d > 0)
    length = np.where(v > 0, 1.0 + np.divide(a, v, out=np.zeros_like(a), where=v > 0), 0.0)
    return {
        "rollout/spec_accept_rate": float(rate.mean()),
        "rollout/spec_accept_length": float(length.mean()),
    }


# --------------------------------------------------------------------------------------------------
# §7.7 staleness


def _mmm(prefix: str, x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {}
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def compute_staleness_metrics(
    min_global_steps: Sequence[int] | np.ndarray,
    max_global_steps: Sequence[int] | np.ndarray,
    global_steps: int,
    mode: str = "training",
) -> dict[str, float]:
    """Per-trajectory off-policy tags (§7.7): ``{mode}/off_policy/trajectory_spans = max − min + 1``,
    ``…/trajectory_staleness = (global_steps − 1) − max``, ``…/trajectory_staleness_worst =
    (global_steps − 1) − min``, each with ``/mean,/max,/min``."""
    lo = np.asarray(min_global_steps, dtype=np.int64)
    hi = np.asarray(max_global_steps, dtype=np.int64)
    p = f"{mode}/off_policy"
    out = {}
    out.update(_mmm(f"{p}/trajectory_spans", hi - lo + 1))
    out.update(_mmm(f"{p}/trajectory_staleness", (global_steps - 1) - hi))
    out.update(_mmm(f"{p}/trajectory_staleness_worst", (global_steps - 1) - lo))
    return out


def compute_eviction_metrics(
    prompt_global_steps: Sequence[int] | np.ndarray,
    global_steps: int,
    mode: str = "training",
    *,
    filtered_groups: int = 0,
    discarded_surplus: int = 0,
    rollout_failures: int = 0,
) -> dict[str, float]:
    """Replay-buffer eviction counters (§7.7): ``{mode}/off_policy/evicted_samples``,
    ``…/evicted_samples_staleness/{mean,max,min}`` (span ``global_steps − prompt_global_steps + 1``),
    ``{mode}/filter_groups/{evicted_samples,discarded_surplus_samples}``,
    ``{mode}/rollout_failure/evicted_samples``."""
    steps = np.asarray(prompt_global_steps, dtype=np.int64)
    out: dict[str, float] = {f"{mode}/off_policy/evicted_samples": float(steps.size)}
    out.update(_mmm(f"{mode}/off_policy/evicted_samples_staleness", global_steps - steps + 1))
    out[f"{mode}/filter_groups/evicted_samples"] = float(filtered_groups)
    out[f"{mode}/filter_groups/discarded_surplus_samples"] = float(discarded_surplus)
    out[f"{mode}/rollout_failure/evicted_samples"] = float(rollout_failures)
    return out


# --------------------------------------------------------------------------------------------------
# reduction / accumulation


class AggregationType(str, Enum):
    """How a :class:`Metric` combines its values."""

    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


class Metric:
    """Accumulates scalar values (floats, ints or 0-dim tensors) and aggregates them."""

    def __init__(self, aggregation: AggregationType | str = AggregationType.MEAN, value: Any = None) -> None:
        """``aggregation``: mean | sum | min | max; ``value``: an optional first value or list of values."""
        self.aggregation = AggregationType(aggregation)
        self.values: list[float] = []
        if value is not None:
            self.extend(value if isinstance(value, (list, tuple)) else [value])

    def append(self, value: Any) -> None:
        """Add one scalar; tensors must have exactly one element."""
        if torch.is_tensor(value):
            if value.numel() != 1:
                raise ValueError(f"Metric.append: expected a scalar tensor, got shape {tuple(value.shape)}")
            value = value.detach().item()
        elif isinstance(value, np.ndarray):
            if value.size != 1:
                raise ValueError(f"Metric.append: expected a scalar array, got shape {value.shape}")
            value = value.item()
        self.values.append(float(value))

    def extend(self, values: Iterable[Any]) -> None:
        """Append several scalars."""
        for v in values:
            self.append(v)

    def aggregate(self) -> float:
        """The aggregate of the values so far (NaN when empty)."""
        if not self.values:
            return _NAN
        fn = {
            AggregationType.MEAN: np.mean,
            AggregationType.SUM: np.sum,
            AggregationType.MIN: np.min,
            AggregationType.MAX: np.max,
        }[self.aggregation]
        return float(fn(self.values))

    @staticmethod
    def aggregate_dp(metrics: Sequence[Metric]) -> float:
        """Combine the same metric from several data-parallel ranks: mean of the per-rank aggregates
        for MEAN and SUM (a SUM metric holds a rank's share of a global mean), min/max across ranks."""
        if not metrics:
            return _NAN
        agg = metrics[0].aggregation
        per_rank = [m.aggregate() for m in metrics]
        if agg is AggregationType.MIN:
            return float(np.min(per_rank))
        if agg is AggregationType.MAX:
            return float(np.max(per_rank))
        return float(np.mean(per_rank))


def append_to_dict(data: dict[str, list], new: Mapping[str, Any]) -> None:
    """Append each value of ``new`` to the list under the same key in ``data`` (created as needed)."""
    for k, v in new.items():
        data.setdefault(k, []).append(v)


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Reduce lists of values per key: max if ``"max"`` is in the key, else min if ``"min"`` is, else
    mean; :class:`Metric` values use their own aggregation."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, Metric):
            out[k] = v.aggregate()
            continue
        arr = np.asarray(
            [x.item() if torch.is_tensor(x) else x for x in v] if isinstance(v, list) else v, dtype=np.float64
        )
        if "max" in k:
            out[k] = float(np.max(arr))
        elif "min" in k:
            out[k] = float(np.min(arr))
        else:
            out[k] = float(np.mean(arr))
    return out


def log_seqlen_unbalance(
    seqlen_list: Sequence[int], partitions: Sequence[Sequence[int]], prefix: str = "global_seqlen"
) -> dict[str, float]:
    """Sequence-length balance before/after reordering: ``{prefix}/min,max,minmax_diff`` over the
    original contiguous equal chunks, ``/balanced_min,balanced_max`` over ``partitions``, and ``/mean``
    (total ÷ number of partitions)."""
    k = len(partitions)
    seqlens = np.asarray(seqlen_list, dtype=np.int64)
    size = len(seqlens) // k
    chunk_sums = [int(seqlens[o : o + size].sum()) for o in range(0, len(seqlens), size)] if size else [0]
    balanced = [int(seqlens[list(p)].sum()) for p in partitions]
    return {
        f"{prefix}/min": min(chunk_sums),
        f"{prefix}/max": max(chunk_sums),
        f"{prefix}/minmax_diff": max(chunk_sums) - min(chunk_sums),
        f"{prefix}/balanced_min": min(balanced),
        f"{prefix}/balanced_max": max(balanced),
        f"{prefix}/mean": int(seqlens.sum()) / k,
    }
