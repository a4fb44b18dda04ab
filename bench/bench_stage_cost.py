"""What a guarded stage costs at the schema benchmark's size, to put validation time in proportion.

Times the cheapest real work of the `old_log_prob` stage — a teacher-forced forward of the CPU default's tiny
policy (hidden 128, 2 layers; `dapo_core.compute.engines.train` forward with log-probs and entropy) — on
slices of 256-token prompts + 2,048-token responses, and extrapolates linearly to the 512 × 16 = 8,192
trajectories of `bench_schemas.py`. Any real model (e.g. Qwen2.5-32B on GPUs) costs far more per token, so
this is a lower bound on the stage cost and an upper bound on validation's share.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_stage_cost.py [--rows 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.models import build_tiny_model

TINY = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2560,
    "tie_word_embeddings": True,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "m", TINY, seed=0)
        engine = make_train_engine("torch", str(path), {"lr": 0.0}, total_steps=1, grad_clip=1.0)
        engine.eval()
        p_len, r_len = 256, 2048
        ids = torch.randint(4, 90, (args.rows, p_len + r_len))
        mask = torch.ones_like(ids)
        pos = torch.arange(p_len + r_len).expand(args.rows, -1)
        times = []
        with torch.no_grad():
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                engine.forward(ids, mask, pos, r_len, temperature=1.0, calculate_entropy=True)
                times.append(time.perf_counter() - t0)
    per_row = statistics.median(times) / args.rows
    total = per_row * 8192
    print(
        f"tiny-model old_log_prob forward: {per_row * 1000:.1f} ms per 2,304-token row (median of "
        f"{args.repeats}), {total:.0f} s extrapolated to 8,192 rows"
    )
    for stage, ms in (("generate", 114), ("old_log_prob", 102), ("advantage", 341)):
        print(f"  validation of {stage:<12} {ms} ms = {100 * ms / 1000 / total:.3f} % of that")


if __name__ == "__main__":
    main()
