"""`dapo plan`'s actor estimate next to the measured peak of one update, on a bigger random-init model (CPU).

For each combination of the memory features, a fresh Python process builds a random-init Qwen2-shaped model
(`--hidden`, `--layers`, ...), runs `measure_actor_update` (one `update_actor` over a mini-batch of full-width
rows; peak = resident high-water mark above the loaded weights, reset through /proc/self/clear_refs) and
prints the plan's estimate of the same bytes (gradients + optimizer + the update pass).

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/bench_plan.py` (about 3-5 minutes on the 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, tempfile, torch
torch.set_num_threads(1)
from dapo_core.config import load_config, typed
from dapo_core.compute.models import build_tiny_model
from tests.helpers import measure_actor_update
cfg = typed(load_config("configs/tiny_cpu.yaml", sys.argv[1:]))
tiny = {k: v for k, v in vars(cfg.actor_rollout_ref.model.tiny).items()}
folder = build_tiny_model(tempfile.mkdtemp(), tiny, seed=0)
print(json.dumps(measure_actor_update(cfg, str(folder))))
"""

FEATURES = {
    "padded": [],
    "ckpt": ["actor_rollout_ref.model.enable_gradient_checkpointing=true"],
    "packed+budget": [
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
    ],
    "ckpt+packed+budget": [
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=448)
    ap.add_argument("--rows", type=int, default=8, help="trajectories in the mini-batch (= one micro-batch)")
    ap.add_argument("--budget", type=int, default=2048)
    args = ap.parse_args()
    shape = [
        f"actor_rollout_ref.model.tiny.hidden_size={args.hidden}",
        f"actor_rollout_ref.model.tiny.intermediate_size={args.intermediate}",
        f"actor_rollout_ref.model.tiny.num_hidden_layers={args.layers}",
        f"actor_rollout_ref.model.tiny.num_attention_heads={args.heads}",
        f"actor_rollout_ref.model.tiny.num_key_value_heads={args.kv_heads}",
        f"actor_rollout_ref.model.tiny.head_dim={args.hidden // args.heads}",
        f"actor_rollout_ref.model.tiny.max_position_embeddings={args.prompt + args.response}",
        f"data.max_prompt_length={args.prompt}",
        f"data.max_response_length={args.response}",
        "actor_rollout_ref.rollout.n=1",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.rows}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.rows}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, i "
        f"{args.intermediate}, V 100; {args.rows} rows × {args.prompt + args.response} tokens; "
        f"budget {args.budget}"
    )
    print("| features | estimated MiB | measured MiB | measured / estimated |")
    print("|---|---|---|---|")
    for name, feats in FEATURES.items():
        overrides = shape + [f.format(budget=args.budget) for f in feats]
        out = subprocess.run(
            [sys.executable, "-c", CHILD, *overrides], cwd=ROOT, capture_output=True, text=True, env=env
        )
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            raise SystemExit(f"{name}: the measurement failed")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {name} | {r['estimated'] / 2**20:,.0f} | {r['measured'] / 2**20:,.0f} | "
            f"{r['measured'] / r['estimated']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
