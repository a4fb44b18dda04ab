"""`vllm` mode: rollout generation tokens/s of the vLLM-CPU engine against the HF engine (run in the main
environment) and transformers' `model.generate`."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dapo_core.compute.engines.rollout import SamplingParams, make_rollout_engine
from dapo_core.compute.models import build_tiny_model, load_model
from rollout.common import SMALL, bench_prompts, median_rate, run_child


def bench_engine(name: str, model: Path, args: argparse.Namespace) -> dict:
    """tokens/s of our rollout engine `name` ("hf" or "vllm") on `model`."""
    prompts = bench_prompts(model, args)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    seeds = list(range(args.rows))
    t0 = time.perf_counter()
    opts = {"max_model_len": args.max_model_len} if name == "vllm" else {"max_batch_size": args.rows}
    engine = make_rollout_engine(name, model, device="cpu", seed=0, **opts)
    build_s = time.perf_counter() - t0
    try:
        rate, tokens, times = median_rate(
            lambda: sum(len(c.token_ids) for c in engine.generate(prompts, params, seeds)), args.repeats
        )
    finally:
        engine.close()
    return {
        "bench": f"{name}_generate",
        "tok_per_s": round(rate, 1),
        "tokens": tokens,
        "times_s": [round(t, 4) for t in times],
        "build_s": round(build_s, 2),
    }


def bench_model_generate(model_path: Path, args: argparse.Namespace) -> dict:
    """tokens/s of transformers' `model.generate` (left-padded batch, sampling at T=1)."""
    model = load_model(model_path)
    prompts = bench_prompts(model_path, args)
    width = max(len(p) for p in prompts)
    eos = int(model.config.eos_token_id)
    # left-padded (the word prompts differ in length); the mask hides the padding
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run() -> int:
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.new_tokens,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        new = out[:, ids.shape[1] :]
        # tokens up to and including the first EOS of each row
        n = 0
        for row in new.tolist():
            n += row.index(eos) + 1 if eos in row else len(row)
        return n

    rate, tokens, times = median_rate(run, args.repeats)
    return {
        "bench": "hf_model_generate",
        "tok_per_s": round(rate, 1),
        "tokens": tokens,
        "times_s": [round(t, 4) for t in times],
    }


def run_vllm(args: argparse.Namespace) -> None:
    """vLLM's engine and `model.generate` here, the HF engine in the main environment; JSON lines."""
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "tiny", SMALL, seed=0)
        if args.only == "hf":  # child mode: one JSON line for the parent
            print(json.dumps(bench_engine("hf", model, args)))
            return
        print(
            f"# loadavg {Path('/proc/loadavg').read_text().split()[:3]}, rows={args.rows}, "
            f"prompt_len={args.prompt_len}, new_tokens={args.new_tokens}",
            flush=True,
        )
        results = []
        if args.only in (None, "vllm"):
            results.append(bench_engine("vllm", model, args))
            print(json.dumps(results[-1]), flush=True)
        if args.only in (None, "hf_model"):
            results.append(bench_model_generate(model, args))
            print(json.dumps(results[-1]), flush=True)
        if args.only is None:
            child = run_child(args, "vllm", model)
            if child:
                results.append(child[-1])
        rates = {r["bench"]: r["tok_per_s"] for r in results}
        if "vllm_generate" in rates:
            ratios = {
                k: round(rates["vllm_generate"] / v, 3) for k, v in rates.items() if k != "vllm_generate"
            }
            print(json.dumps({"bench": "ratio_vllm_over", **ratios}))
