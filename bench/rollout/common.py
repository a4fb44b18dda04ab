"""What the rollout modes share: the small model's shape, the rows they generate from, timing, and the run
of a mode's HF side in the main environment (`--only hf`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""

SCRIPT = ROOT / "bench" / "bench_rollout.py"
"""The command-line entry point (`run_child` runs it again under the main environment's interpreter)."""

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"""The two-layer model of 64 hidden units (`engines`, `vllm`, `lora`)."""


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


def run_child(args: argparse.Namespace, mode: str, model: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    """Run `mode --only hf` with the main environment's interpreter (`--hf-python`) on `model`; its JSON
    lines (none when the interpreter is missing or the run fails, said on stderr), each printed too."""
    if not (args.hf_python and Path(args.hf_python).is_file()):
        return []
    cmd = [args.hf_python, str(SCRIPT), mode, "--only", "hf", "--model", str(model), *extra]
    for flag in ("rows", "prompt_len", "new_tokens", "repeats", "threads", "n", "max_model_len"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.word_prompts:
        cmd.append("--word-prompts")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(
            f"# {mode} --only hf failed (rc={proc.returncode}): {proc.stderr.strip()[-800:]}", file=sys.stderr
        )
        return []
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines
