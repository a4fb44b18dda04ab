"""`engines` mode: the compute layer on the small model, HF generation tokens/s and one `ppo_update`
mini-batch's tokens/s per training engine (torch, DeepSpeed ZeRO)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from dapo_core.compute.engines.rollout import SamplingParams, make_rollout_engine
from dapo_core.compute.models import build_tiny_model
from rollout.common import SMALL


def _median_rate(fn, tokens: int, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times)


def _loss(log_probs, entropy, micro, info):
    mask = micro["response_mask"]
    loss = -(log_probs * mask).sum() / info["batch_num_tokens"]
    return loss, {}


def run_engines(args: argparse.Namespace) -> None:
    """HF generation tokens/s, then one update's tokens/s per training engine; one JSON line each."""
    from dapo_core.compute.engines.ppo import ppo_update
    from dapo_core.compute.engines.train import make_train_engine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, SMALL, seed=0)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(4, 99, (args.rows, args.prompt_len), generator=g).tolist()

        eng = make_rollout_engine("hf", path, max_batch_size=args.rows, progress=False, eos_token_id=-1)
        sp = SamplingParams(max_new_tokens=args.new_tokens)
        seeds = list(range(args.rows))
        rate = _median_rate(
            lambda: eng.generate(prompts, sp, seeds), args.rows * args.new_tokens, args.repeats
        )
        print(
            json.dumps(
                {
                    "bench": "hf_generate",
                    "tokens_per_s": round(rate),
                    "rows": args.rows,
                    "new_tokens": args.new_tokens,
                    "threads": args.threads,
                }
            )
        )

        total = args.prompt_len + args.new_tokens
        ids = torch.randint(4, 99, (args.rows, total), generator=g)
        mask = torch.ones_like(ids)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": mask.cumsum(-1) - 1,
            "response_mask": mask[:, args.prompt_len :].float(),
        }
        strategies = ["torch"] + ([] if args.no_deepspeed else ["deepspeed"])
        for strategy in strategies:
            kw = {"deepspeed_cfg": {"zero_stage": args.zero_stage}} if strategy == "deepspeed" else {}
            train = make_train_engine(strategy, path, {"lr": 1e-4}, total_steps=100, grad_clip=1.0, **kw)

            def update(train=train):
                ppo_update(
                    train, batch, loss_fn=_loss, mini_batch_size=args.rows, micro_batch_size=args.micro_batch
                )

            rate = _median_rate(update, args.rows * total, args.repeats)
            name = f"{strategy}_update" + (f"_zero{args.zero_stage}" if strategy == "deepspeed" else "")
            print(
                json.dumps(
                    {
                        "bench": name,
                        "tokens_per_s": round(rate),
                        "rows": args.rows,
                        "seq_len": total,
                        "micro_batch": args.micro_batch,
                        "threads": args.threads,
                    }
                )
            )
            train.close()
