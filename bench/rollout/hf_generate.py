"""`hf` mode: our HF rollout engine (and its SDPA-decode variant, and optionally another checkout's engine)
against transformers' `model.generate` on prompt groups."""

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

TINY_CPU = {
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


def run_hf(args: argparse.Namespace) -> None:
    """Time our engine, its SDPA-decode variant and `model.generate`; print JSON lines."""
    torch.set_num_threads(args.threads)
    rows = args.prompts * args.n
    tokens = rows * args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, TINY_CPU, seed=0)
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
