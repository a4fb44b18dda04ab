"""The GPU path of weights on the move, on the device under test (`tests/gpu/conftest.py`): FSDP2 on NCCL at
world size 1 with bf16 compute and a float32 gradient reduce; the bucketed same-device push from an actor
process to an HF-engine rollout process on the same GPU (CUDA IPC; shared memory in the CPU dry run) with
greedy equality after the push; and a model of SmolLM2-135M's shape generating on the device.

Only torch, transformers and safetensors are needed (the GPU machine's image has no Ray or Prefect)."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

import pytest
import torch

from dapo_core.compute.dist import free_port
from tests.gpu.conftest import DEVICE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (DAPO_GPU_TESTS_ON_CPU=1 dry-runs on CPU)"),
]

OPTIM = {"lr": 1e-2, "weight_decay": 0.0}
PROMPTS = [[5, 9, 14, 3], [7, 7, 21], [30, 2, 11, 8, 4]]
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
"""SmolLM2-135M-Instruct's depth, width and heads (its weights cannot be carried to the lent machine)."""


def _greedy(engine: Any) -> list[list[int]]:
    from dapo_core.compute.engines.rollout import SamplingParams

    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, do_sample=False), [0, 1, 2])
    return [list(o.token_ids) for o in outs]


def test_fsdp2_world1_bf16_compute_reduces_in_float32(tiny_dir, device, record):
    from dapo_core.compute.engines.fsdp2_train import FSDP2TrainEngine

    eng = FSDP2TrainEngine(
        tiny_dir, OPTIM, total_steps=2, grad_clip=1.0, device=device, compute_dtype=torch.bfloat16
    )
    assert eng.mp_policy.param_dtype == torch.bfloat16 and eng.mp_policy.reduce_dtype == torch.float32
    before = {n: p.detach().to_local().clone() for n, p in eng.model.named_parameters()}
    ids = torch.tensor([PROMPTS[0] * 4], device=eng.device)
    eng.model(input_ids=ids).logits.float().pow(2).mean().backward()
    grad_dtypes = {p.grad.dtype for p in eng.model.parameters() if p.grad is not None}
    norm = eng.step()
    moved = max(
        float((p.detach().to_local() - before[n]).abs().max()) for n, p in eng.model.named_parameters()
    )
    backend = torch.distributed.get_backend()
    record("fsdp2_world1", {"backend": backend, "grad_norm": norm, "moved": moved, "device": device})
    assert backend == ("nccl" if device == "cuda" else "gloo")
    assert grad_dtypes == {torch.float32} and moved > 0 and norm == norm


def _actor_side(model: str, export: str, link: dict, device: str, out: Any) -> None:
    """The actor process: a training engine on the device, one update, its HF export, then the push."""
    try:
        from dapo_core.compute.engines.train import make_train_engine
        from dapo_core.compute.weight_transport import Link, send_all

        eng = make_train_engine("torch", model, OPTIM, total_steps=2, grad_clip=1.0, device=device)
        ids = torch.tensor([PROMPTS[2] * 3], device=device)
        eng.model(input_ids=ids).logits.float().pow(2).mean().backward()
        eng.step()
        eng.export_hf(export)
        t0 = time.perf_counter()
        stats = send_all(eng.iter_sync_tensors(torch.float32), [Link(**link)], rank=0)
        out.put(("actor", stats.bytes, stats.max_message_bytes, stats.buckets, time.perf_counter() - t0))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _rollout_side(model: str, link: dict, device: str, out: Any) -> None:
    """The rollout process: an HF engine on the same device, greedy before and after receiving the push."""
    try:
        from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
        from dapo_core.compute.weight_transport import Link, receive_into

        eng = HFRolloutEngine(model, device=device)
        before = _greedy(eng)
        spec = Link(**link)
        receive_into(spec, 0, lambda named: eng.load_tensors(named), expect=eng.weight_names())
        out.put(("rollout", before, _greedy(eng)))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def test_same_device_push_to_a_rollout_process_gives_the_exported_models_greedy(
    tiny_dir, device, tmp_path, record
):
    from dataclasses import asdict

    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
    from dapo_core.compute.weight_transport import Link

    bucket = 64 << 10  # several buckets, the embedding split over two
    link = Link(
        "same_device", 0, 1, "127.0.0.1", free_port("127.0.0.1"), bucket, "float32", device, "gpu-ipc"
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    export = tmp_path / "export"
    procs = [
        ctx.Process(target=_actor_side, args=(str(tiny_dir), str(export), asdict(link), device, out)),
        ctx.Process(target=_rollout_side, args=(str(tiny_dir), asdict(link), device, out)),
    ]
    for p in procs:
        p.start()
    try:
        got = {r[0]: r for r in (out.get(timeout=240) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert "error" not in got, got["error"][1]
    _, nbytes, max_msg, buckets, seconds = got["actor"]
    _, before, after = got["rollout"]
    want = _greedy(HFRolloutEngine(export, device=device))
    kind = "CUDA IPC" if device == "cuda" else "shared memory (CPU dry run)"
    record("same_device_push", {"kind": kind, "bytes": nbytes, "buckets": buckets, "seconds": seconds})
    assert max_msg <= bucket and buckets >= 2
    assert after == want, "the rollout's greedy output after the push differs from the exported model's"
    assert before != after, "the update did not change the greedy output: the comparison is vacuous"


def test_smollm2_shaped_model_generates_on_the_device(device, tmp_path, record):
    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
    from dapo_core.compute.engines.rollout import SamplingParams
    from dapo_core.compute.models import build_tiny_model

    folder = build_tiny_model(tmp_path / "smollm2_shape", SMOLLM2_SHAPE, seed=0)
    dtype = "bfloat16" if device == "cuda" else "float32"
    eng = HFRolloutEngine(folder, device=device, dtype=dtype)
    rows, new = (32, 64) if device == "cuda" else (4, 8)
    prompts = [[(7 * i + j) % 40 + 3 for j in range(24)] for i in range(rows)]
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    eng.generate(prompts[:2], params, [0, 1])  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params, list(range(rows)))
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    record(
        "smollm2_shape_generate", {"rows": rows, "tokens": tokens, "tok_s": tokens / seconds, "peak": peak}
    )
    assert tokens > 0 and all(len(o.log_probs) == len(o.token_ids) for o in outs)
    assert all(lp <= 0 for o in outs for lp in o.log_probs)
