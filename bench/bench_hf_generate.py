"""Our HF rollout engine against transformers' own `model.generate` on the shape RL asks for: groups.

A generation batch of GRPO/DAPO is `prompts × n` rows where the n samples of a prompt share it. Both sides get
the same rows (each prompt repeated n times, left-padded, no EOS stop so every row generates `--new-tokens`),
the same model (the CPU default's tiny Qwen2 shape, random init) and sampling at temperature 1:
- `engine`: `HFRolloutEngine.generate` (per-row seeded sampling: a row never depends on its neighbours);
- `model_generate`: `model.generate(do_sample=True)` with one global RNG (what TRL's non-vLLM path calls);
- `engine_sdpa_decode`: our engine with PyTorch's SDPA in the decode steps (`decode_attention=False`) instead
  of `engines.decode_attention`.

With `--baseline-tree DIR` (a checkout of an older commit, e.g. `git worktree add /tmp/base a09042c`) the
engine of that tree runs too, interleaved with ours in the same process, and the outputs are compared
bit for bit. Prints one JSON line per side (median tokens/s of `--repeats`) and the ratios. Run:
`OMP_NUM_THREADS=1 .venv/bin/python bench/bench_hf_generate.py` (defaults: 32 prompts × n 8, 30-token prompts,
32 new tokens: the CPU default's generation batch). Check /proc/loadavg: compare the ratio, not the rates.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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


def _median_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, the functions interleaved round by round (load hits all alike)."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _baseline_engine_class(tree: str) -> type:
    """`HFRolloutEngine` as defined in another checkout's hf_rollout.py (imported under a private name)."""
    path = Path(tree) / "dapo_core/compute/engines/hf_rollout.py"
    spec = importlib.util.spec_from_file_location("baseline_hf_rollout", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline-tree: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HFRolloutEngine


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
    ap.add_argument("--baseline-tree", default=None, help="an older checkout whose engine to compare")
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

        sdpa_engine = make_rollout_engine(
            "hf",
            path,
            max_batch_size=args.max_batch_size,
            progress=False,
            eos_token_id=-1,
            decode_attention=False,
        )
        fns: dict[str, Callable[[], object]] = {
            "engine": lambda: engine.generate(prompts, params, seeds),
            "engine_sdpa_decode": lambda: sdpa_engine.generate(prompts, params, seeds),
            "model_generate": plain,
        }
        if args.baseline_tree:
            baseline = _baseline_engine_class(args.baseline_tree)(
                path, max_batch_size=args.max_batch_size, progress=False, eos_token_id=-1
            )
            fns["baseline_engine"] = lambda: baseline.generate(prompts, params, seeds)
            same = [
                (a.token_ids, a.log_probs) == (b.token_ids, b.log_probs)
                for a, b in zip(fns["engine"](), fns["baseline_engine"](), strict=True)
            ]
            print(json.dumps({"bench": "engine_equals_baseline_bitwise", "value": all(same)}))
        seconds = _median_seconds(fns, args.repeats)
    shape = {
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
    }
    for name, t in seconds.items():
        print(json.dumps({"bench": name, "tokens_per_s": round(tokens / t), "seconds": round(t, 4), **shape}))
    for name, t in seconds.items():
        if name != "engine":
            print(json.dumps({"bench": f"engine_speed_vs_{name}", "ratio": round(t / seconds["engine"], 2)}))


if __name__ == "__main__":
    main()
