"""Our HF rollout engine against transformers' own `model.generate` on the shape RL asks for: groups.

A generation batch of GRPO/DAPO is `prompts × n` rows where the n samples of a prompt share it. Both sides get
the same rows (each prompt repeated n times, left-padded, no EOS stop so every row generates `--new-tokens`),
the same model (the CPU default's tiny Qwen2 shape, random init) and sampling at temperature 1:
- `engine`: `HFRolloutEngine.generate` (per-row seeded sampling: a row never depends on its neighbours);
- `model_generate`: `model.generate(do_sample=True)` with one global RNG (what TRL's non-vLLM path calls).

Prints one JSON line per side (median tokens/s of `--repeats`) and their ratio. Run:
`OMP_NUM_THREADS=1 .venv/bin/python bench/bench_hf_generate.py` (defaults: 32 prompts × n 8, 30-token prompts,
32 new tokens: the CPU default's generation batch). Check /proc/loadavg: compare the ratio, not the rates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from dapo_core.compute.engines.rollout import SamplingParams, make_rollout_engine
from dapo_core.compute.models import build_tiny_model, load_model

TINY = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
"""The model shape of configs/tiny_cpu.yaml."""


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    """Parse arguments, time both sides, print JSON lines."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=256, help="rows per forward of our engine")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = args.prompts * args.n
    tokens = rows * args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, TINY, seed=0)
        g = torch.Generator().manual_seed(0)
        base = torch.randint(4, 99, (args.prompts, args.prompt_len), generator=g)
        ids = base.repeat_interleave(args.n, dim=0)

        engine = make_rollout_engine(
            "hf", path, max_batch_size=args.max_batch_size, progress=False, eos_token_id=-1
        )
        params = SamplingParams(max_new_tokens=args.new_tokens)
        prompts, seeds = ids.tolist(), list(range(rows))
        t_engine = _median_seconds(lambda: engine.generate(prompts, params, seeds), args.repeats)

        model = load_model(path)

        def plain() -> object:
            with torch.no_grad():
                return model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    eos_token_id=None,
                    pad_token_id=0,
                )

        t_plain = _median_seconds(plain, args.repeats)
    shape = {
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }
    for name, t in (("engine", t_engine), ("model_generate", t_plain)):
        print(json.dumps({"bench": name, "tokens_per_s": round(tokens / t), "seconds": round(t, 4), **shape}))
    print(json.dumps({"bench": "engine_speed_vs_model_generate", "ratio": round(t_plain / t_engine, 2)}))


if __name__ == "__main__":
    main()
