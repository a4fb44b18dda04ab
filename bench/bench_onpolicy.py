"""On-policy skip of the old_log_prob forward, timed on the actor alone (no orchestration or generation).

The CPU default's policy (`models/tiny_base`) and its on-policy batch shape (`ppo_mini_batch_size` =
`train_batch_size` = 16 prompts × n 8, 32 new tokens, micro-batches of 64): one batch is generated once, then
two actors from the same weights alternate round by round — `separate`: `compute_log_prob` then `update_actor`
(what the flow ran before), `skip`: `update_actor` on the batch without `old_log_probs` (what it runs now when
`old_log_prob_needed` is None). Prints medians over `--repeats` rounds and the weights' largest difference
after all rounds.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_onpolicy.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny_base"))
    args = ap.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from dapo_core.compute.models import load_tokenizer
    from dapo_core.compute.workers import ActorWorker, RolloutWorker
    from dapo_core.data import batch as B
    from dapo_core.data.datasets import PromptSampler
    from dapo_core.seeding import uid_factory
    from dapo_core.stages import compute_advantage_table

    torch.set_num_threads(1)
    tok = load_tokenizer(args.model)
    sampler = PromptSampler(pq.read_table(ROOT / "data" / "train.parquet"), tok, batch_size=16, seed=1)
    prompts = B.repeat_interleave_prompts(sampler.next_batch(), 8, uid_fn=uid_factory(0, "bench"))
    s = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 32, "do_sample": True}
    table = RolloutWorker(args.model, seed=1, train_sampling=s, val_sampling=s).generate(prompts, gen_step=1)
    rewards = [float(i % 3 == 0) for i in range(table.num_rows)]
    table = table.append_column("reward", pa.array(rewards, pa.float32()))
    actor_cfg = {
        "strategy": "torch",
        "optim": {"lr": 1e-4, "lr_warmup_steps": 0, "weight_decay": 0.1},
        "ppo_mini_batch_size": 16,
        "ppo_micro_batch_size_per_gpu": 64,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 10.0,
        "loss_agg_mode": "token-mean",
    }
    pad = int(tok.pad_token_id)

    def actor() -> ActorWorker:
        opts = {"pad_token_id": pad, "temperature": 1.0, "rollout_n": 8, "total_steps": 100}
        return ActorWorker(args.model, actor_cfg, log_prob_micro_batch_size=64, **opts)

    sep, skip = actor(), actor()
    times: dict[str, list[float]] = {"separate": [], "skip": []}
    for i in range(args.repeats):
        t0 = time.perf_counter()
        with_old = sep.compute_log_prob(table)
        adv, _ = compute_advantage_table(with_old, pad_token_id=pad, adv_estimator="grpo")
        sep.update_actor(adv, global_steps=i + 1)
        times["separate"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        adv, _ = compute_advantage_table(table, pad_token_id=pad, adv_estimator="grpo")
        skip.update_actor(adv, global_steps=i + 1)
        times["skip"].append(time.perf_counter() - t0)
    a, b = sep.weights(), skip.weights()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"{table.num_rows} trajectories, {args.repeats} rounds (interleaved), model {args.model}")
    print("| path | old_log_prob + advantage + update (s, median) |")
    print("|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.3f} |")
    ratio = statistics.median(times["skip"]) / statistics.median(times["separate"])
    print(
        f"skip / separate = {ratio:.2f}; largest weight difference after {args.repeats} updates: {diff:.2e}"
    )


if __name__ == "__main__":
    main()
