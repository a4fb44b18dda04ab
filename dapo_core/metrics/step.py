"""Per-step training metrics with the reference (verl NEWEST) key names (docs/REFERENCE.md §7).

- :func:`compute_data_metrics` — ``critic/*``, ``response_length*``, ``prompt_length/*`` (§7.1, incl.
  the aborted / non-aborted split: a row with an empty response is *aborted*);
- :func:`compute_timing_metrics`, :func:`compute_throughput_metrics` (§7.2).

A batch is the dict of padded tensors of ``dapo_core.data.batch.to_padded`` plus ``token_level_scores`` /
``token_level_rewards`` / ``advantages`` / ``returns`` (/ ``values``), as the train flow builds it. Validation
metrics (mean@k, maj@k, pass@k) are in ``dapo_core.metrics.validation``; the replay buffer's staleness and
eviction metrics (§7.7) are computed by ``dapo_core.store.replay.ReplayBuffer.sample``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["compute_data_metrics", "compute_throughput_metrics", "compute_timing_metrics"]

_NAN = float("nan")


def _lengths(b: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(prompt_length, response_length, max_prompt_length, max_response_length), lengths as float tensors."""
    rl = torch.as_tensor(b["response_length"]).float()
    pl = torch.as_tensor(b["prompt_length"]).float()
    return pl, rl, int(b["prompts"].shape[-1]), int(b["responses"].shape[-1])


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


def compute_data_metrics(batch: Mapping[str, Any], use_critic: bool = True) -> dict[str, float]:
    """Batch statistics with the reference keys (NEWEST §7.1).

    ``critic/score|rewards/{mean,max,min}`` over per-sequence sums of ``token_level_scores`` /
    ``token_level_rewards`` of non-aborted rows (NaN if all are aborted); ``critic/advantages|returns``
    over valid tokens (``response_mask``); with ``use_critic`` also ``critic/values/*`` and
    ``critic/vf_explained_var = 1 − var(R−V)/(var(R)+1e-5)`` (unbiased var); ``response_length/*``,
    ``response_length_non_aborted/*`` (with ``clip_ratio`` = fraction at the padded width),
    ``response/aborted_ratio`` and ``prompt_length/*`` (clip ratios relative to the padded widths).
    """
    b = batch
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
    return metrics


# --------------------------------------------------------------------------------------------------
# §7.2 timing and throughput


def _token_counts(batch: Mapping[str, Any]) -> tuple[int, int]:
    """(response tokens, prompt+response tokens) of a batch."""
    pl, rl, _, _ = _lengths(batch)
    r = int(rl.sum().item())
    return r, r + int(pl.sum().item())


_ALL_TOKEN_SECTIONS = ("ref", "values", "adv", "update_critic", "update_actor")


def compute_timing_metrics(batch: Mapping[str, Any], timing_raw: Mapping[str, float]) -> dict[str, float]:
    """``timing_s/{name}`` for every timer and ``timing_per_token_ms/{name}`` for ``gen`` (per response
    token) and ``ref, values, adv, update_critic, update_actor`` (per prompt+response token); 0.0 when
    the batch has no such tokens."""
    n_resp, n_all = _token_counts(batch)
    tokens = {"gen": n_resp, **dict.fromkeys(_ALL_TOKEN_SECTIONS, n_all)}
    out = {f"timing_s/{name}": float(v) for name, v in timing_raw.items()}
    for name, v in timing_raw.items():
        if name in tokens:
            out[f"timing_per_token_ms/{name}"] = float(v) * 1000.0 / tokens[name] if tokens[name] else 0.0
    return out


def compute_throughput_metrics(
    batch: Mapping[str, Any], timing_raw: Mapping[str, float], n_gpus: int
) -> dict[str, float]:
    """``perf/total_num_tokens`` (prompt+response tokens of the batch), ``perf/time_per_step =
    timing_raw['step']`` and ``perf/throughput = total / (time · n_gpus)``."""
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
