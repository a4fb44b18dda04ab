"""The PPO update loop: `ppo_update` runs epochs of mini-batch updates of a training engine, through
`minibatch_update`, the mini-batch / micro-batch loop the critic shares.

It normalises as NEWEST verl does, by the mini-batch's global token count: each micro-batch loss is
back-propagated as it is, so the update does not depend on how a mini-batch is split. It knows nothing about
DAPO: the caller's `loss_fn` composes policy loss, entropy bonus and KL. One rank is the simple case of
data-parallel ranks, each training on its share of every mini-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from dapo_core.compute.dist import DataParallel, dp_split
from dapo_core.compute.engines.train import TrainEngine
from dapo_core.compute.microbatch import grouped_order, row_token_costs, shared_prompts, token_budget_split

__all__ = ["LossFn", "minibatch_update", "ppo_update"]

LossFn = Callable[
    [torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor], dict[str, Any]],
    tuple[torch.Tensor, Mapping[str, Any]],
]


_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def _as_float(v: Any) -> float:
    return float(v.detach().item()) if isinstance(v, torch.Tensor) else float(v)


MicroLoss = Callable[[dict[str, torch.Tensor], dict[str, Any]], tuple[torch.Tensor, Mapping[str, Any]]]


def minibatch_update(
    batch_tensors: Mapping[str, torch.Tensor],
    *,
    micro_loss: MicroLoss,
    backward: Callable[[torch.Tensor], None],
    optimizer_step: Callable[[], Mapping[str, float]],
    device: torch.device | str,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    sum_keys: tuple[str, ...] = (),
    token_budget: int | None = None,
    row_tokens: torch.Tensor | None = None,
    row_groups: torch.Tensor | None = None,
    row_lengths: torch.Tensor | None = None,
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """The PPO mini-batch / micro-batch loop shared by the actor (`ppo_update`) and the critic, on one rank
    or on each of `dp` data-parallel ranks (one rank: its share is the whole mini-batch, in order).

    For each of `epochs` passes (rows in a permutation seeded by `seed` when `shuffle`, else in order), each
    mini-batch of `mini_batch_size` rows is one optimizer step: every micro-batch of `micro_batch_size` rows
    (moved to `device`) gives `micro_loss(micro_batch, global_batch_info) -> (loss, metrics)` and
    `backward(loss)` (no division by the number of micro-batches: the loss is already normalised by
    `global_batch_info = {dp_size: 1, batch_num_tokens: Σ response_mask of the mini-batch, global_batch_size:
    its rows}`), then `optimizer_step()` steps and returns its own metrics (grad norm, lr). Returns the
    metrics averaged over mini-batches, where a mini-batch's value of a `micro_loss` metric is its sum over
    micro-batches for `sum_keys` and its mean otherwise.

    With `token_budget` (verl's `use_dynamic_bsz`), micro-batches are formed by `token_budget_split` over
    `row_tokens` (B,) — the tokens each row costs the forward (`microbatch.row_token_costs`) — instead of
    by `micro_batch_size`; the loss normalisation is the same mini-batch-wide `global_batch_info`, so the
    update does not depend on the split.

    With `row_groups` (B,), e.g. each row's prompt, the fixed-size micro-batches of a rank's share take its
    rows with equal values next to each other (`microbatch.grouped_order`), so a shared-prompt forward sees
    whole groups, and with `row_lengths` (B,) (each row's response tokens) the groups go longest first, so
    that a micro-batch holds groups of similar length and pads less; the mini-batches themselves, and so the
    update, are unchanged (float summation order aside).

    With `dp` (data-parallel ranks, each holding the whole batch), each rank takes its share of every
    mini-batch (`dist.dp_split` by tokens; the same split on every rank) and `global_batch_info` carries
    `dp_size` and the whole mini-batch's token count, so with FSDP's gradient averaging the step equals one
    process's over the whole mini-batch. Ranks run the same number of micro-batches (a rank with fewer adds
    passes over the mini-batch's first row with zero loss), and the metrics are combined over the ranks.
    """
    n = int(batch_tensors["response_mask"].shape[0])
    if token_budget is not None and (row_tokens is None or int(row_tokens.shape[0]) != n):
        raise ValueError(f"ppo_update: a token budget needs row_tokens with one entry per row ({n} rows).")
    _check_sizes(n, mini_batch_size, micro_batch_size, epochs)
    dp_size = 1 if dp is None else dp.size
    gen = torch.Generator().manual_seed(int(seed))
    per_mini: dict[str, list[float]] = {}
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
        for start in range(0, n, mini_batch_size):
            idx = order[start : start + mini_batch_size]
            mini = {k: v[idx] for k, v in batch_tensors.items() if isinstance(v, torch.Tensor)}
            info = {
                "dp_size": dp_size,
                "batch_num_tokens": int(mini["response_mask"].sum().item()),
                "global_batch_size": int(idx.numel()),
            }
            mine = _rank_rows(mini, dp)
            splits = _micro_splits(
                mine,
                micro_batch_size,
                token_budget=token_budget,
                row_tokens=None if row_tokens is None else row_tokens[idx],
                row_groups=None if row_groups is None else row_groups[idx],
                row_lengths=None if row_lengths is None else row_lengths[idx],
            )
            weights = [1.0] * len(splits)
            if dp is not None and dp_size > 1:
                for _pad in range(dp.max_int(len(splits)) - len(splits)):
                    splits.append(torch.zeros(1, dtype=torch.long))  # a zero-loss pass keeps ranks in step
                    weights.append(0.0)
            sums: dict[str, float] = {}
            means: dict[str, list[tuple[float, float]]] = {}
            for part, w in zip(splits, weights, strict=True):
                micro = {k: v[part].to(device) for k, v in mini.items()}
                loss, metrics = micro_loss(micro, info)
                backward(loss * w)
                for k, v in metrics.items():
                    if k in sum_keys:
                        sums[k] = sums.get(k, 0.0) + w * _as_float(v)
                    else:
                        means.setdefault(k, []).append((w, _as_float(v)))
            row = _mini_batch_metrics(sums, means, dp)
            row.update(optimizer_step())
            for k, v in row.items():
                per_mini.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in per_mini.items()}


def _rank_rows(mini: Mapping[str, torch.Tensor], dp: DataParallel | None) -> torch.Tensor:
    """Positions in the mini-batch of the rows this rank trains on: all of them, in order, on one rank; with
    data-parallel ranks its share by tokens (`dist.dp_split`, the same split on every rank)."""
    rows = int(mini["response_mask"].shape[0])
    if dp is None or dp.size == 1:
        return torch.arange(rows)
    costs = mini["attention_mask"].sum(dim=-1).tolist()
    return torch.tensor(dp_split(costs, dp.size)[dp.rank], dtype=torch.long)


def _micro_splits(
    mine: torch.Tensor,
    micro_batch_size: int,
    *,
    token_budget: int | None,
    row_tokens: torch.Tensor | None,
    row_groups: torch.Tensor | None,
    row_lengths: torch.Tensor | None,
) -> list[torch.Tensor]:
    """The micro-batches over the rows `mine` (positions in the mini-batch, whose per-row `row_tokens`,
    `row_groups` and `row_lengths` are given): by `token_budget` when set, else `micro_batch_size` rows each,
    taken in prompt-group order when `row_groups` is given."""
    if token_budget is not None:
        assert row_tokens is not None
        groups = token_budget_split(row_tokens[mine], token_budget)
        return [mine[torch.tensor(g, dtype=torch.long)] for g in groups]
    if row_groups is not None:
        lengths = None if row_lengths is None else row_lengths[mine]
        mine = mine[grouped_order(row_groups[mine], lengths)]
    return [mine[m0 : m0 + micro_batch_size] for m0 in range(0, mine.numel(), micro_batch_size)]


def _mini_batch_metrics(
    sums: dict[str, float], means: dict[str, list[tuple[float, float]]], dp: DataParallel | None
) -> dict[str, float]:
    """One mini-batch's metrics: the `sums` as they are and the weighted mean of each of `means`' (weight,
    value) lists; with data-parallel ranks, both combined over the ranks (zero-weight passes left out)."""
    if dp is None or dp.size == 1:
        return {**sums, **{k: float(np.mean([v for _, v in pairs])) for k, pairs in means.items()}}
    msum = {k: sum(w * v for w, v in pairs) for k, pairs in means.items()}
    mcnt = {k: sum(w for w, _ in pairs) for k, pairs in means.items()}
    total = dp.mean_metrics(
        {
            **{f"s/{k}": v for k, v in sums.items()},
            **{f"m/{k}": v for k, v in msum.items()},
            **{f"c/{k}": v for k, v in mcnt.items()},
        }
    )
    row = {k: total[f"s/{k}"] for k in sums}
    row.update({k: total[f"m/{k}"] / total[f"c/{k}"] for k in msum if total[f"c/{k}"] > 0})
    return row


def _check_sizes(n: int, mini_batch_size: int, micro_batch_size: int, epochs: int) -> None:
    if mini_batch_size < 1 or n % mini_batch_size != 0:
        raise ValueError(
            f"ppo_update: batch of {n} rows is not a multiple of mini_batch_size={mini_batch_size} "
            "(ppo_mini_batch_size × rollout.n); make them divide."
        )
    if micro_batch_size < 1:
        raise ValueError(
            f"ppo_update: micro_batch_size={micro_batch_size} must be >= 1 (ppo_micro_batch_size_per_gpu)."
        )
    if epochs < 1:
        raise ValueError(f"ppo_update: epochs={epochs} must be >= 1 (ppo_epochs).")


def ppo_update(
    engine: TrainEngine,
    batch_tensors: Mapping[str, torch.Tensor],
    *,
    loss_fn: LossFn,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    sum_keys: tuple[str, ...] = ("actor/pg_loss",),
    max_token_len: int | None = None,
    remove_padding: bool = False,
    share_prompt: bool = False,
    dp: DataParallel | None = None,
) -> dict[str, float]:
    """Run `epochs` passes of mini-batch updates of `engine` over `batch_tensors` (`minibatch_update`).

    `batch_tensors` holds (B, ·) tensors including input_ids, attention_mask, position_ids and
    response_mask (B, L). For each micro-batch the engine computes log-probs (and entropy when
    `calculate_entropy`) and `loss_fn(log_probs, entropy, micro_batch, global_batch_info) -> (loss, metrics)`
    gives the loss to back-propagate. Metrics: `loss_fn`'s (mean over micro- and mini-batches, except
    `sum_keys`, e.g. `actor/pg_loss`, summed over micro-batches), `actor/grad_norm` and `actor/lr`.
    `max_token_len` (`ppo_max_token_len_per_gpu` with `use_dynamic_bsz`) forms micro-batches by a token
    budget instead of `micro_batch_size`; `remove_padding` runs packed forwards (`use_remove_padding`);
    `share_prompt` runs each distinct prompt of a micro-batch once (`use_shared_prompt`).
    """
    for key in (*_MODEL_INPUTS, "response_mask"):
        if key not in batch_tensors:
            raise KeyError(
                f"ppo_update: batch_tensors lacks {key!r}; build it with dapo_core.data.batch.to_padded."
            )
    resp_len = int(batch_tensors["response_mask"].shape[1])

    def micro_loss(
        micro: dict[str, torch.Tensor], info: dict[str, Any]
    ) -> tuple[torch.Tensor, Mapping[str, Any]]:
        log_probs, entropy = engine.forward(
            micro["input_ids"],
            micro["attention_mask"],
            micro["position_ids"],
            resp_len,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            remove_padding=remove_padding,
            share_prompt=share_prompt,
        )
        return loss_fn(log_probs, entropy, micro, info)

    def optimizer_step() -> dict[str, float]:
        grad_norm = engine.step()
        return {"actor/grad_norm": float(grad_norm), "actor/lr": float(engine.lr)}

    engine.train()
    return minibatch_update(
        batch_tensors,
        micro_loss=micro_loss,
        backward=engine.backward,
        optimizer_step=optimizer_step,
        device=engine.device,
        mini_batch_size=mini_batch_size,
        micro_batch_size=micro_batch_size,
        epochs=epochs,
        shuffle=shuffle,
        seed=seed,
        sum_keys=sum_keys,
        token_budget=max_token_len,
        row_tokens=(
            row_token_costs(batch_tensors["attention_mask"], remove_padding)
            if max_token_len is not None
            else None
        ),
        row_groups=_prompt_groups(batch_tensors, resp_len) if share_prompt else None,
        row_lengths=batch_tensors["response_mask"].sum(dim=-1) if share_prompt else None,
        dp=dp,
    )


def _prompt_groups(batch_tensors: Mapping[str, torch.Tensor], response_length: int) -> torch.Tensor | None:
    """(B,) each row's prompt (`shared_prompts` over the whole batch), or None when no two rows share one."""
    groups = shared_prompts(batch_tensors["input_ids"], batch_tensors["attention_mask"], response_length)
    return None if groups is None else groups.inverse
