"""Shared-prompt forwards (`use_shared_prompt`) against the per-row padded forward, through the actor worker.

A GRPO/DAPO batch is `prompts × n` trajectories whose n responses share their prompt. The per-row forward runs
every prompt n times. The shared forward runs each distinct prompt of a micro-batch once, in one of two
layouts: `grouped` (the default where it saves positions: one row per prompt group, the responses back to back
under a 4-D mask) or `cache` (the prompts with a KV cache, the responses on copies of it; forced here with a
zero mask budget); `grouped_first` is `grouped` with the prompt groups of a mini-batch in the order of their
first row (the default orders them longest first, so a micro-batch pads less). The
batch mimics the CPU default's training batch in the side-by-side benchmark's shape
(`--prompts` × `--n`, prompts of `--prompt-min`..`--prompt-max` tokens, responses lognormal around
`--response-median`, capped at `--response-max`). With `--order balanced` its rows come in
`trainer.balance_batch`'s length order, as the flow hands them to the actor; `--no-group-micro` then leaves
the micro-batches in that order (not grouped by prompt). Every path runs the
production code (`ActorWorker.compute_log_prob` without grad, `ActorWorker.update_actor`: forward, backward,
AdamW over one mini-batch of the whole batch), interleaved, medians of `--repeats`.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/bench_shared_prompt.py --order balanced` (about a minute on the
2-core machine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import torch

from dapo_core.compute import microbatch
from dapo_core.compute.engines import train as train_engines
from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.workers import actor as actor_worker
from dapo_core.compute.workers.actor import ActorWorker
from dapo_core.config import load_config
from dapo_core.config.schema import ActorConfig
from dapo_core.data import batch as B


def tiny_shape() -> dict:
    """`configs/tiny_cpu.yaml`'s model shape."""
    return dict(load_config("configs/tiny_cpu.yaml", [])["actor_rollout_ref"]["model"]["tiny"])


def batch(args: argparse.Namespace) -> pa.Table:
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    prompts, responses, adv = [], [], []
    for _ in range(args.prompts):
        plen = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=g))
        prompt = torch.randint(4, 99, (plen,), generator=g).tolist()
        a = float(torch.randn(1, generator=g))
        for _ in range(args.n):
            drawn = round(rng.lognormal(np.log(args.response_median), 0.35))
            rlen = int(min(args.response_max, max(1, drawn)))
            prompts.append(prompt)
            responses.append(torch.randint(4, 99, (rlen,), generator=g).tolist())
            adv.append([a] * rlen)
    table = pa.table({"prompt_ids": prompts, "response_ids": responses, "advantages": adv})
    if args.order == "balanced":
        seqlens = B.prompt_lengths(table) + B.response_lengths(table)
        table = table.take(pa.array(B.balance_order(seqlens, dp_size=1)))
    return table


@contextlib.contextmanager
def layout(path: str, group_micro: bool) -> Iterator[None]:
    """Run the shared forwards in `path`'s layout ("cache": a zero mask budget declines every grouping;
    "grouped_first": prompt groups in the order of their first row, as before they went longest first) and,
    without `group_micro`, leave fixed-size micro-batches in the batch's own order."""
    saved = (microbatch.MAX_GROUP_MASK_ELEMENTS, train_engines.grouped_order, actor_worker.grouped_order)
    if path == "cache":
        microbatch.MAX_GROUP_MASK_ELEMENTS = 0
    if path == "grouped_first":

        def first_row_order(keys: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
            return microbatch.grouped_order(keys)

        train_engines.grouped_order = actor_worker.grouped_order = first_row_order
    if not group_micro:

        def batch_order(keys: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
            return torch.arange(keys.numel())

        train_engines.grouped_order = actor_worker.grouped_order = batch_order
    try:
        yield
    finally:
        microbatch.MAX_GROUP_MASK_ELEMENTS, train_engines.grouped_order, actor_worker.grouped_order = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=44)
    ap.add_argument("--prompt-max", type=int, default=45)
    ap.add_argument("--response-median", type=float, default=14.0)
    ap.add_argument("--response-max", type=int, default=32)
    ap.add_argument("--order", choices=["grouped", "balanced"], default="balanced")
    ap.add_argument("--no-group-micro", action="store_true", help="micro-batches in the batch's own order")
    ap.add_argument("--micro", type=int, default=64, help="ppo_micro_batch_size_per_gpu (rows)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table = batch(args)
    cfg = ActorConfig(ppo_mini_batch_size=args.prompts, ppo_micro_batch_size_per_gpu=args.micro)
    actor_cfg = dataclasses.asdict(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=5e-5)))
    paths = {"per_row": False, "cache": True, "grouped_first": True, "grouped": True}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, tiny_shape(), seed=0)
        workers = {
            name: ActorWorker(
                str(path),
                actor_cfg,
                pad_token_id=0,
                temperature=1.0,
                rollout_n=args.n,
                total_steps=10 * args.repeats + 10,
                log_prob_micro_batch_size=args.micro,
                use_shared_prompt=share,
            )
            for name, share in paths.items()
        }
        times: dict[str, dict[str, list[float]]] = {k: {"log_probs": [], "update": []} for k in workers}
        for i in range(args.repeats + 1):  # the first round warms up and is left out
            for name, w in workers.items():
                with layout(name, not args.no_group_micro):
                    t = time.perf_counter()
                    w.compute_log_prob(table)
                    t_lp = time.perf_counter() - t
                    t = time.perf_counter()
                    w.update_actor(table, i + 1)
                    t_up = time.perf_counter() - t
                if i:
                    times[name]["log_probs"].append(t_lp)
                    times[name]["update"].append(t_up)
    rlens = B.response_lengths(table)
    print(
        json.dumps(
            {
                "rows": table.num_rows,
                "order": args.order,
                "group_micro": not args.no_group_micro,
                "response_mean": round(float(np.mean(rlens)), 1),
                "response_max": int(np.max(rlens)),
            }
        )
    )
    for name, t in times.items():
        print(
            json.dumps(
                {
                    "path": name,
                    "log_probs_s": round(statistics.median(t["log_probs"]), 3),
                    "update_s": round(statistics.median(t["update"]), 3),
                }
            )
        )


if __name__ == "__main__":
    main()
