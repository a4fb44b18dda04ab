"""Padded vs packed (padding-free) forwards on a long-tailed length mix, through the actor worker.

The batch mimics DAPO's response lengths at CPU scale: prompts uniform in [32, 96] tokens, responses
lognormal (median `--median`, sigma `--sigma`) capped at `--max-resp` (the cap is hit, as DAPO's 20,480 is).
Two paths of `ActorWorker`, the production code:

- `log-probs` (`compute_log_prob`, no grad): padded = micro-batches of `--micro` rows, each padded to its own
  longest row (today's default); packed = `use_remove_padding` + `log_prob_max_token_len=--budget`.
- `update` (`update_actor`: forward + backward + AdamW over one mini-batch): padded = micro-batches of
  `--micro` rows padded to the batch's width (what `ppo_update` slices); packed = `use_dynamic_bsz` with
  `ppo_max_token_len_per_gpu=--budget` + `use_remove_padding`.

Reports valid tokens, tokens the forward processed, the share of padding, seconds (median of `--repeats`)
and valid tokens/s. Packed attention runs one causal SDPA per row (`dapo_core.compute.varlen_attention`;
torch's flash varlen kernel on a GPU): Σ len² per micro-batch, no (N, N) mask.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/bench_packing.py` (about 2-4 minutes on the 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import torch

from dapo_core.compute.microbatch import token_budget_split
from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.workers.actor import ActorWorker
from dapo_core.config.schema import ActorConfig

MODEL = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def make_table(rows: int, median: float, sigma: float, max_resp: int, seed: int) -> pa.Table:
    """Prompts uniform in [32, 96], responses lognormal(median, sigma) capped at max_resp; rewards random."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(32, 97, size=rows)
    rlens = np.minimum(np.maximum(rng.lognormal(np.log(median), sigma, size=rows).astype(int), 1), max_resp)
    prompts = [rng.integers(4, 99, size=p).tolist() for p in plens]
    responses = [rng.integers(4, 99, size=r).tolist() for r in rlens]
    return pa.table(
        {
            "prompt_ids": pa.array(prompts, type=pa.list_(pa.int32())),
            "response_ids": pa.array(responses, type=pa.list_(pa.int32())),
            "old_log_probs": pa.array(
                [(-4.6 + 0.1 * rng.standard_normal(r)).tolist() for r in rlens], type=pa.list_(pa.float32())
            ),
            "advantages": pa.array(
                [[float(a)] * int(r) for a, r in zip(rng.standard_normal(rows), rlens, strict=True)],
                type=pa.list_(pa.float32()),
            ),
        }
    )


def processed_tokens(plens: np.ndarray, rlens: np.ndarray, groups: list[list[int]], own_width: bool) -> int:
    """Tokens the forwards process: each group padded to its own longest prompt/response, or to the
    batch's."""
    if not own_width:
        return len(plens) * int(plens.max() + rlens.max())
    return sum(len(g) * int(plens[g].max() + rlens[g].max()) for g in groups)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--median", type=float, default=96.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-resp", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8, help="rows per padded micro-batch")
    ap.add_argument("--budget", type=int, default=2048, help="token budget of a packed micro-batch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    table = make_table(args.rows, args.median, args.sigma, args.max_resp, args.seed)
    plens = np.array([len(x) for x in table.column("prompt_ids").to_pylist()])
    rlens = np.array([len(x) for x in table.column("response_ids").to_pylist()])
    valid = int(plens.sum() + rlens.sum())
    actor_cfg = dataclasses.asdict(
        ActorConfig(ppo_mini_batch_size=args.rows, ppo_micro_batch_size_per_gpu=args.micro)
    )
    actor_cfg["optim"]["lr"] = 1e-6
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(tmp, MODEL, seed=0)

        def worker(dynamic: bool, packed: bool) -> ActorWorker:
            cfg = {**actor_cfg, "use_dynamic_bsz": dynamic, "ppo_max_token_len_per_gpu": args.budget}
            return ActorWorker(
                str(model),
                cfg,
                pad_token_id=0,
                temperature=1.0,
                rollout_n=1,
                total_steps=100,
                log_prob_micro_batch_size=args.micro,
                log_prob_max_token_len=args.budget if dynamic else None,
                use_remove_padding=packed,
            )

        fixed = [list(range(s, min(s + args.micro, args.rows))) for s in range(0, args.rows, args.micro)]
        packed_groups = token_budget_split(plens + rlens, args.budget)
        for path in ("log-probs", "update"):
            for name, dynamic, packed in (("padded", False, False), ("packed", True, True)):
                w = worker(dynamic, packed)
                if path == "log-probs":
                    seconds = timed(
                        lambda w=w: w.compute_log_prob(table, calculate_entropy=True), args.repeats
                    )
                    proc = valid if packed else processed_tokens(plens, rlens, fixed, own_width=True)
                else:
                    seconds = timed(lambda w=w: w.update_actor(table, 0), args.repeats)
                    proc = valid if packed else processed_tokens(plens, rlens, fixed, own_width=False)
                row = {
                    "path": path,
                    "forward": name,
                    "valid_tokens": valid,
                    "processed_tokens": proc,
                    "padding_share": round(1 - valid / proc, 3),
                    "micro_batches": len(packed_groups) if packed else len(fixed),
                    "seconds": round(seconds, 3),
                    "valid_tokens_per_s": round(valid / seconds, 1),
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    print(
        f"\nlength mix: {args.rows} rows, prompts 32-96, responses lognormal(median {args.median:g}, sigma "
        f"{args.sigma:g}) capped at {args.max_resp}: mean response {rlens.mean():.0f}, max {rlens.max()}, "
        f"{int((rlens == args.max_resp).sum())} at the cap"
    )
    print("| path | forward | processed tokens | padding share | micro-batches | s | valid tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['path']} | {r['forward']} | {r['processed_tokens']:,} | {r['padding_share']:.1%} | "
            f"{r['micro_batches']} | {r['seconds']} | {r['valid_tokens_per_s']:,.0f} |"
        )
    for path in ("log-probs", "update"):
        pad, pk = (r for r in results if r["path"] == path)
        print(f"{path}: packed is {pad['seconds'] / pk['seconds']:.2f}x the padded tokens/s")


if __name__ == "__main__":
    main()
