"""`lora` mode: a LoRA run's two ways to the rollout per engine, the merged weights pushed with
`sync_weights` against the adapter loaded each sync, and the torch training engine's export of each."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dapo_core.compute.engines.rollout import SamplingParams, make_rollout_engine
from dapo_core.compute.models import build_tiny_model
from rollout.common import SMALL, bench_prompts, median_rate, run_child

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
