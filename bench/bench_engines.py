"""Benchmark the compute layer on the tiny model: HF generation tokens/s and update tokens/s.

Measures (1 thread by default, median of `--repeats`):
- `hf_generate`: sampled tokens per second of `HFRolloutEngine.generate` (rows × max_new_tokens, no EOS stop);
- `torch_update` / `deepspeed_update`: (prompt+response) tokens per second of one `ppo_update` mini-batch step
  (forward + backward + AdamW) with the torch engine and DeepSpeed ZeRO-`--zero-stage`.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/bench_engines.py` (add `--no-deepspeed` to skip DeepSpeed,
whose first start on a machine JIT-compiles an op for about a minute). Check `/proc/loadavg` first: the
numbers are only comparable on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from dapo_core.compute.engines.rollout import SamplingParams, make_rollout_engine
from dapo_core.compute.engines.train import make_train_engine, ppo_update
from dapo_core.compute.models import build_tiny_model

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


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


def main() -> None:
    """Parse arguments, run the benchmarks, print one JSON line per measurement."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--zero-stage", type=int, default=1)
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, TINY, seed=0)
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


if __name__ == "__main__":
    main()
