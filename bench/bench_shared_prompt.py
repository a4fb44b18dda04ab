"""Shared-prompt forwards (`use_shared_prompt`) against the per-row padded forward, through the actor worker.

A GRPO/DAPO batch is `prompts × n` trajectories whose n responses share their prompt. The per-row forward runs
every prompt n times; the shared one runs each distinct prompt of a micro-batch once with a KV cache and the
responses on it. The batch mimics the CPU default's training batch (`--prompts` × `--n`, prompts uniform in
[`--prompt-min`, `--prompt-max`] tokens, responses uniform in [8, 32]) on the default's tiny model shape;
both paths run the production code (`ActorWorker.compute_log_prob` without grad, `ActorWorker.update_actor`:
forward, backward, AdamW over one mini-batch of the whole batch), interleaved, medians of `--repeats`. It
reports the token positions each path's forwards process and the seconds.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/bench_shared_prompt.py` (about a minute on the 2-core machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import pyarrow as pa
import torch

from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.workers.actor import ActorWorker
from dapo_core.config import load_config
from dapo_core.config.schema import ActorConfig


def tiny_shape() -> dict:
    """`configs/tiny_cpu.yaml`'s model shape."""
    return dict(load_config("configs/tiny_cpu.yaml", [])["actor_rollout_ref"]["model"]["tiny"])


def batch(args: argparse.Namespace) -> pa.Table:
    g = torch.Generator().manual_seed(0)
    prompts, responses, adv = [], [], []
    for _ in range(args.prompts):
        plen = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=g))
        prompt = torch.randint(4, 99, (plen,), generator=g).tolist()
        a = float(torch.randn(1, generator=g))
        for _ in range(args.n):
            rlen = int(torch.randint(8, 33, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(4, 99, (rlen,), generator=g).tolist())
            adv.append([a] * rlen)
    return pa.table({"prompt_ids": prompts, "response_ids": responses, "advantages": adv})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=50)
    ap.add_argument("--prompt-max", type=int, default=63)
    ap.add_argument("--micro", type=int, default=64, help="ppo_micro_batch_size_per_gpu (rows)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table = batch(args)
    rows = table.num_rows
    plens = [len(p) for p in table.column("prompt_ids").to_pylist()]
    rlens = [len(r) for r in table.column("response_ids").to_pylist()]
    micro = args.micro
    per_row = sum(  # each micro-batch padded to its widest prompt + widest response, every row
        len(range(s, min(s + micro, rows))) * (max(plens[s : s + micro]) + max(rlens[s : s + micro]))
        for s in range(0, rows, micro)
    )
    shared = sum(  # distinct prompts once (to the widest), responses to the widest response
        len(set(range(s, min(s + micro, rows))) & set(range(s, rows, args.n))) * max(plens[s : s + micro])
        + len(range(s, min(s + micro, rows))) * max(rlens[s : s + micro])
        for s in range(0, rows, micro)
    )
    cfg = ActorConfig(ppo_mini_batch_size=args.prompts, ppo_micro_batch_size_per_gpu=micro)
    actor_cfg = dataclasses.asdict(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=5e-5)))
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
                log_prob_micro_batch_size=micro,
                use_shared_prompt=share,
            )
            for name, share in (("per_row", False), ("shared", True))
        }
        times: dict[str, dict[str, list[float]]] = {k: {"log_probs": [], "update": []} for k in workers}
        for i in range(args.repeats + 1):  # the first round warms up and is left out
            for name, w in workers.items():
                t = time.perf_counter()
                w.compute_log_prob(table)
                t_lp = time.perf_counter() - t
                t = time.perf_counter()
                w.update_actor(table, i + 1)
                t_up = time.perf_counter() - t
                if i:
                    times[name]["log_probs"].append(t_lp)
                    times[name]["update"].append(t_up)
    tokens = {"per_row": per_row, "shared": shared}
    for name, t in times.items():
        print(
            json.dumps(
                {
                    "path": name,
                    "rows": rows,
                    "token_positions": tokens[name],
                    "log_probs_s": round(statistics.median(t["log_probs"]), 3),
                    "update_s": round(statistics.median(t["update"]), 3),
                }
            )
        )
    for part in ("log_probs", "update"):
        ratio = statistics.median(times["per_row"][part]) / statistics.median(times["shared"][part])
        print(json.dumps({"speedup": part, "ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()
