"""What both step orders do around the stages: the size of each dynamic-sampling refill, the reward history
the history sampler learns from, and the per-step metrics.
"""

from __future__ import annotations

import functools

from dapo_core.algo.dynamic_sampling import KeepRateEstimator, surplus_bounded_size
from dapo_core.config import (
    DapoConfig,
    gen_batch_size,
)
from dapo_core.data.sampler import MIXED, HistorySampler, group_outcomes
from dapo_core.metrics.step import compute_throughput_metrics, compute_timing_metrics
from dapo_core.stages import batch_data_metrics
from tasks import runtime


def observe_rewards(rt: runtime.Runtime, reward_uri: str) -> dict[str, float]:
    """Feed a scored generation batch's per-group outcomes to a `HistorySampler` (nothing otherwise); returns
    its metrics: the share of the batch's groups without reward spread and of draws passed over so far."""
    inner = rt.sampler.sampler
    if not isinstance(inner, HistorySampler):
        return {}
    table = rt.store.read_uri(reward_uri, verify=False, columns=["prompt_id", "acc"])
    pids, accs = table.column("prompt_id").to_pylist(), table.column("acc").to_pylist()
    outcomes = [c for codes in group_outcomes(pids, accs).values() for c in codes]
    inner.observe(pids, accs)
    draws = max(inner.passed_over + inner.drawn, 1)
    return {
        "train/history_sampler/zero_spread_share": sum(c != MIXED for c in outcomes) / max(len(outcomes), 1),
        "train/history_sampler/passed_over_share": inner.passed_over / draws,
    }


def add_metrics(metrics: dict[str, float], new: dict[str, float]) -> None:
    """Fold a generation batch's metrics into the step's: times, token counts and added groups add up, any
    other key keeps its latest value."""
    for key, v in new.items():
        summed = key.startswith(("timing_s/", "perf/")) or key == "train/added_groups"
        metrics[key] = metrics.get(key, 0.0) + v if summed else v


def refill_size(cfg: DapoConfig, keep_rate: KeepRateEstimator, deficit: int, fixed: int) -> int:
    """Prompts to generate for `deficit` missing groups: `fixed`, or with `algorithm.filter_groups.refill=
    adaptive` the largest batch whose expected surplus under the observed keep rate stays within
    `filter_groups.surplus_budget · train_batch_size` groups (`surplus_bounded_size`; `gen_batch_size` before
    any rate is observed); 0 when nothing is missing."""
    if deficit <= 0:
        return 0
    fg = cfg.algorithm.filter_groups
    if fg.enable and fg.refill == "adaptive":
        budget = fg.surplus_budget * cfg.data.train_batch_size
        return surplus_bounded_size(deficit, keep_rate.rate, surplus_budget=budget, base=gen_batch_size(cfg))
    return fixed


def step_metrics(rt: runtime.Runtime, step: int, adv_uri: str, metrics: dict) -> dict:
    """Data, timing and throughput metrics of a finished step (docs/REFERENCE.md §7.1–7.2 key names). The
    data metrics are computed on the reward worker, which reads the advantage view from the store; the
    driver gets a few numbers and the per-row lengths, never the table."""
    import torch

    out, lengths = rt.reward.summarize(
        str(rt.store.root), adv_uri, functools.partial(batch_data_metrics, pad_token_id=rt.pad_token_id)
    )
    timing = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("timing_s/")}
    timing.setdefault("gen", timing.get("generate", 0.0))  # the reference's timer names (§7.2) for our stages
    if "advantage" in timing:
        timing.setdefault("adv", timing["advantage"])
    counts = {k: torch.tensor(v, dtype=torch.long) for k, v in lengths.items()}
    counts |= {"prompts": torch.empty(0, 0), "responses": torch.empty(0, 0)}  # widths: unused by §7.2
    out.update(compute_timing_metrics(counts, timing))
    out.update(compute_throughput_metrics(counts, timing, n_gpus=1))
    return out
