"""GPU checks of the compute layer (`dapo_core.compute.engines`, `dapo_core.compute.models`) on `cuda`.

(a) `HFRolloutEngine`'s per-token log-probs equal the torch training engine's teacher-forced recompute
    (float32, on cuda, and across devices: cuda rollout vs cpu recompute);
(b) a torch-engine PPO update (`ppo_update` with the actor's loss `actor_objective`, as `ActorLoss`
    calls it: clip-higher + dual-clip policy loss, entropy bonus, low-var-KL loss) gives the
    same loss trajectory on cuda as on cpu; plus the `ActorWorker` path itself (cpu batch tensors, engine
    on cuda);
(c) a single-process DeepSpeed ZeRO-2 update on cuda (nccl) matches the torch engine (skipped when the
    deepspeed package cannot be imported);
(d) generation throughput of the HF engine on a larger tiny model (hidden 512, 4 layers), printed;
(e) the torch engine's bf16 autocast update on the device stays near its float32 one.

Skipped on machines without CUDA. `DAPO_GPU_TESTS_ON_CPU=1` dry-runs everything on cpu (see conftest.py).
Run: `PYTHONPATH=. python3 -m pytest tests/gpu -m gpu -q -rA` (the script is bench/gpu_check.sh).

Tolerances (float32, TF32 disabled in conftest.py):
- log-probs, 1e-4 absolute. The rollout computes each step's logits with a KV cache and a 1-token query,
  the recompute runs one causal forward over the whole sequence: same math, different kernels and
  reduction orders (cuBLAS picks other tilings for M=1 than for M=T; SDPA takes other paths). float32's
  unit roundoff is 6e-8; a dot product of length K <= 1408 carries about sqrt(K)·u ~ 2e-6 relative error,
  a handful of layers and the log-softmax (whose error is at most twice the largest logit error) keep
  it around 1e-5 for O(1..10) logits. 1e-4 is ~10x that bound yet far below any real bug (a wrong
  position id, mask or temperature moves log-probs by 1e-2 or more). The worst gap is recorded.
- loss trajectory cuda vs cpu: 2e-5 absolute on the losses / KL / entropy metrics, 1e-4 relative on grad
  norms, 2e-4 on the final weights. AdamW's first steps normalise each gradient element by its own
  magnitude (update ≈ lr·sign(g)), so float32 noise in tiny gradient elements becomes O(lr) weight
  differences that grow over steps. Calibration on cpu (float32 vs float64, same trajectory): losses
  differ by <= 9e-8, grad norms by <= 5e-7 relative, weights by <= 1.8e-6 — the tolerances leave >= 100x
  margin over float32 noise, while one skipped or doubled step moves the losses by 1e-2 or more (the test
  also asserts the trajectory spans > 50x LOSS_ATOL and that clipping is exercised). Measured on the H200
  (2026-11-29): losses 2.7e-8, grad norms 2e-7 relative, weights 7.3e-6.
- DeepSpeed ZeRO-2 vs torch on cuda: the same 2e-5 / 1e-4 / 2e-4 (ZeRO flattens gradients into buckets,
  so its global norm — and the clip factor — is summed in another order; the CPU unit test uses 1e-5).
  Measured on the H200: losses 2.9e-8, weights 1.0e-6.
- bf16 autocast vs float32 on the device: 2e-2 absolute on the losses, 10 % on grad norms (the CPU dry run
  differs by 1.2e-4 and 1 %; bf16 keeps 8 bits of mantissa, so 1e-3-level loss differences are expected).
- Measured log-prob gaps on the H200: <= 4.8e-7 (hidden 64) and <= 1.4e-6 (hidden 512), cuda rollout vs
  cuda and vs cpu recompute.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_core.algo.losses import PolicyLossParams, actor_objective
from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
from dapo_core.compute.engines.ppo import ppo_update
from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.models import load_tokenizer
from dapo_core.data import batch as B

_DRY = os.environ.get("DAPO_GPU_TESTS_ON_CPU") == "1"
DEV = "cuda" if torch.cuda.is_available() else ("cpu" if _DRY else None)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEV is None,
        reason=(
            "needs a CUDA GPU (torch.cuda.is_available() is False); DAPO_GPU_TESTS_ON_CPU=1 dry-runs on cpu"
        ),
    ),
]

LOGPROB_ATOL = 1e-4
LOSS_ATOL = 2e-5
GRAD_NORM_RTOL = 1e-4
WEIGHT_ATOL = 2e-4
DS_ATOL = 2e-5
BF16_LOSS_ATOL = 2e-2
BF16_GRAD_RTOL = 0.1

OPTIM = {
    "lr": 2e-3,
    "betas": (0.9, 0.99),
    "weight_decay": 0.01,
    "lr_warmup_steps": 1,
    "warmup_style": "constant",
}
ACTOR = {  # DAPO's actor settings (verl names), as ActorWorker reads them
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 10.0,
    "loss_agg_mode": "token-mean",
    "entropy_coeff": 1e-3,
    "kl_loss_coef": 1e-3,
    "kl_loss_type": "low_var_kl",
}

TEXTS = [
    "1+1=",
    "What is the answer to life, the universe and everything?",
    "x",
    "Hello\nworld",
    "12*12=",
    "Solve for y: 3y + 4 = 19.",
    "The quick brown fox",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "0",
    "Let me think step by step.",
    "abc def ghi jkl mno pqr stu vwx yz",
    "?",
]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- (a) rollout vs recompute
def _pack(prompts, completions):
    """The teacher-forcing inputs of prompts + completions, built as the workers build them (`to_padded`,
    cpu)."""
    table = pa.table(
        {
            "prompt_ids": pa.array(prompts, pa.list_(pa.int64())),
            "response_ids": pa.array([c.token_ids for c in completions], pa.list_(pa.int64())),
        }
    )
    t = B.to_padded(table, 0)
    return t["input_ids"], t["attention_mask"], t["position_ids"], t["responses"].shape[1]


def _worst_gap(completions, recomputed) -> float:
    worst = 0.0
    for i, c in enumerate(completions):
        got = torch.tensor(c.log_probs, dtype=torch.float32)
        worst = max(worst, float((got - recomputed[i, : len(got)].float().cpu()).abs().max()))
    return worst


@pytest.mark.parametrize("model", ["tiny", "bigger"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=40),
        SamplingParams(max_new_tokens=24, temperature=1.0),
        SamplingParams(max_new_tokens=24, do_sample=False),
    ],
    ids=["t0.8-p0.9-k40", "t1.0", "greedy"],
)
def test_rollout_log_probs_match_teacher_forced(request, model, params, record):
    model_dir = request.getfixturevalue(f"{model}_dir")
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    seeds = list(range(100, 100 + len(prompts)))
    # max_batch_size 5 < 12 rows: exercises micro-batching and rows leaving the KV cache as they end.
    roll = HFRolloutEngine(model_dir, device=DEV, max_batch_size=5, progress=False)
    completions = roll.generate(prompts, params, seeds)
    assert len(completions) == len(prompts)
    for c in completions:
        assert 1 <= len(c.token_ids) == len(c.log_probs) <= params.max_new_tokens
        assert all(np.isfinite(c.log_probs)) and max(c.log_probs) <= 1e-6
    again = roll.generate(prompts, params, seeds)
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]  # seeded, deterministic

    ids, mask, pos, length = _pack(prompts, completions)
    gaps = {}
    for where in dict.fromkeys([DEV, "cpu"]):  # on cuda: the cuda recompute and the cross-device one
        train = make_train_engine("torch", model_dir, {"lr": 0.0}, total_steps=1, grad_clip=1.0, device=where)
        train.eval()
        lp, _ = train.forward(ids, mask, pos, length, temperature=params.logprob_temperature)
        assert lp.device.type == torch.device(where).type
        gaps[where] = _worst_gap(completions, lp)
        train.close()
    roll.close()
    pid = request.node.callspec.id
    record(
        f"logprob_gap[{pid}]",
        {
            "rollout_device": DEV,
            **{f"recompute_{k}": v for k, v in gaps.items()},
            "tokens": sum(len(c.token_ids) for c in completions),
        },
    )
    for where, gap in gaps.items():
        assert gap <= LOGPROB_ATOL, f"rollout({DEV}) vs teacher-forced({where}): worst |Δlogp| = {gap:.3g}"


# --------------------------------------------------------------------------- (b) PPO update cuda vs cpu
def _dapo_loss_fn(log_probs, entropy, mb, gbi):
    """The actor's loss (`actor_objective`, as ActorWorker calls it) with DAPO's clip settings plus an entropy
    bonus and a low-var-KL loss, so every term is exercised: pg − c_H·entropy + c_KL·KL (token-mean)."""
    return actor_objective(
        mb["old_log_probs"],
        log_probs,
        mb["advantages"],
        mb["response_mask"],
        loss_mode="vanilla",
        params=PolicyLossParams(
            clip_ratio_low=ACTOR["clip_ratio_low"],
            clip_ratio_high=ACTOR["clip_ratio_high"],
            clip_ratio_c=ACTOR["clip_ratio_c"],
        ),
        loss_agg_mode=ACTOR["loss_agg_mode"],
        entropy=entropy,
        entropy_coeff=ACTOR["entropy_coeff"],
        ref_log_prob=mb["ref_log_probs"],
        kl_loss_coef=ACTOR["kl_loss_coef"],
        kl_loss_type=ACTOR["kl_loss_type"],
        global_batch_info=gbi,
    )


def _make_batch(n=8, prompt_len=7, resp_len=12, seed=0, vocab=99):
    """Left-padded prompts, right-padded responses of varied lengths, random advantages (cpu tensors)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, prompt_len + resp_len), generator=g)
    mask = torch.ones_like(ids)
    for i in range(n):
        mask[i, : i % 4] = 0
        mask[i, prompt_len + resp_len - (3 * i) % 7 :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": mask[:, prompt_len:].float(),
        "advantages": torch.randn(n, resp_len, generator=g),
    }


def _trajectory(
    model_dir,
    device,
    batch,
    *,
    steps=4,
    strategy="torch",
    deepspeed_cfg=None,
    move_batch=True,
    compute_dtype=None,
):
    """`steps` DAPO train steps: on-policy old log-probs, then 2 epochs × 2 mini-batches × 2 micro-batches.

    Returns (per-step metrics, final weights on cpu). `move_batch=False` hands ppo_update cpu tensors
    (what ActorWorker does: dapo_core.data.batch.to_padded builds them on cpu).
    """
    eng = make_train_engine(
        strategy,
        model_dir,
        OPTIM,
        total_steps=steps,
        grad_clip=1.0,
        device=device,
        deepspeed_cfg=deepspeed_cfg,
        compute_dtype=compute_dtype,
    )
    try:
        resp_len = batch["response_mask"].shape[1]
        eng.eval()
        ref, _ = eng.forward(batch["input_ids"], batch["attention_mask"], batch["position_ids"], resp_len)
        ref = ref.detach()
        rows = []
        for step in range(steps):
            eng.eval()
            old, _ = eng.forward(batch["input_ids"], batch["attention_mask"], batch["position_ids"], resp_len)
            tensors = {**batch, "old_log_probs": old.detach().cpu(), "ref_log_probs": ref.cpu()}
            if move_batch:
                tensors = {k: v.to(eng.device) for k, v in tensors.items()}
            m = ppo_update(
                eng,
                tensors,
                loss_fn=_dapo_loss_fn,
                mini_batch_size=4,
                micro_batch_size=2,
                epochs=2,
                shuffle=True,
                seed=step,
                calculate_entropy=True,
            )
            eng.lr_step()
            rows.append(m)
        weights = {k: v.detach().float().cpu().clone() for k, v in eng.state_dict_for_sync().items()}
        return rows, weights
    finally:
        eng.close()


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _series(rows, key):
    return np.array([r[key] for r in rows], dtype=np.float64)


def test_ppo_update_cuda_matches_cpu(tiny_dir, record):
    batch = _make_batch()
    cpu_rows, cpu_w = _trajectory(tiny_dir, "cpu", batch)
    dev_rows, dev_w = _trajectory(tiny_dir, DEV, batch)
    loss_c, loss_d = _series(cpu_rows, "actor/pg_loss"), _series(dev_rows, "actor/pg_loss")
    gn_c, gn_d = _series(cpu_rows, "actor/grad_norm"), _series(dev_rows, "actor/grad_norm")
    record(
        "ppo_trajectory",
        {
            "device": DEV,
            "pg_loss_cpu": loss_c.tolist(),
            "pg_loss_dev": loss_d.tolist(),
            "grad_norm_cpu": gn_c.tolist(),
            "grad_norm_dev": gn_d.tolist(),
            "max_abs_loss_diff": float(np.abs(loss_c - loss_d).max()),
            "max_rel_grad_norm_diff": float((np.abs(gn_c - gn_d) / gn_c).max()),
            "max_weight_diff": _max_diff(cpu_w, dev_w),
            "ppo_kl_dev": _series(dev_rows, "actor/ppo_kl").tolist(),
            "clipfrac_dev": _series(dev_rows, "actor/pg_clipfrac").tolist(),
        },
    )
    assert np.isfinite(loss_d).all() and np.isfinite(gn_d).all()
    assert np.ptp(loss_c) > 50 * LOSS_ATOL  # the trajectory moves: the comparison is not vacuous
    assert max(r["actor/pg_clipfrac"] for r in cpu_rows) > 0  # 2nd epoch is off-policy: clipping is exercised
    np.testing.assert_allclose(loss_d, loss_c, atol=LOSS_ATOL, rtol=0)
    np.testing.assert_allclose(gn_d, gn_c, rtol=GRAD_NORM_RTOL)
    for key in ("actor/kl_loss", "actor/entropy_loss", "actor/ppo_kl"):
        np.testing.assert_allclose(_series(dev_rows, key), _series(cpu_rows, key), atol=LOSS_ATOL, rtol=0)
    assert _max_diff(cpu_w, dev_w) <= WEIGHT_ATOL
    assert [r["actor/lr"] for r in dev_rows] == [r["actor/lr"] for r in cpu_rows]


def test_bf16_autocast_update_on_device_stays_near_float32(tiny_dir, record):
    """`actor.fsdp_config.mixed_precision.param_dtype: bf16` on the device: the torch engine's autocast
    trajectory stays within bf16's error of the float32 one (losses within BF16_LOSS_ATOL, grad norms within
    BF16_GRAD_RTOL)."""
    batch = _make_batch()
    ref_rows, _ = _trajectory(tiny_dir, DEV, batch)
    rows, _ = _trajectory(tiny_dir, DEV, batch, compute_dtype=torch.bfloat16)
    loss_r, loss_b = _series(ref_rows, "actor/pg_loss"), _series(rows, "actor/pg_loss")
    gn_r, gn_b = _series(ref_rows, "actor/grad_norm"), _series(rows, "actor/grad_norm")
    record(
        "bf16_autocast_trajectory",
        {
            "device": DEV,
            "max_abs_loss_diff": float(np.abs(loss_r - loss_b).max()),
            "max_rel_grad_norm_diff": float((np.abs(gn_r - gn_b) / gn_r).max()),
        },
    )
    assert np.isfinite(loss_b).all() and np.isfinite(gn_b).all()
    assert not np.array_equal(gn_b, gn_r)  # bf16 arithmetic did run
    np.testing.assert_allclose(loss_b, loss_r, atol=BF16_LOSS_ATOL, rtol=0)
    np.testing.assert_allclose(gn_b, gn_r, rtol=BF16_GRAD_RTOL)


def test_ppo_update_accepts_cpu_batch_with_engine_on_device(tiny_dir, record):
    """ActorWorker.update_actor hands ppo_update the cpu tensors of dapo_core.data.batch.to_padded while the
    engine (and so the log-probs) live on the device: the update must still run and match."""
    batch = _make_batch(seed=1)
    ref_rows, _ = _trajectory(tiny_dir, DEV, batch, steps=2, move_batch=True)
    try:
        rows, _ = _trajectory(tiny_dir, DEV, batch, steps=2, move_batch=False)
    except RuntimeError as e:
        record("cpu_batch_on_device", {"error": str(e).splitlines()[0][:300]})
        pytest.fail(
            "ppo_update with cpu batch tensors and the engine on "
            f"{DEV} failed — ActorWorker on cuda would fail the same way: {str(e).splitlines()[0][:200]}"
        )
    np.testing.assert_allclose(
        _series(rows, "actor/pg_loss"), _series(ref_rows, "actor/pg_loss"), atol=LOSS_ATOL, rtol=0
    )


def _actor_table(tok, n_prompts=4, n=2, resp_len=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_ids, response_ids, adv = [], [], []
    for i in range(n_prompts):
        p = tok.encode(TEXTS[i])
        for j in range(n):
            r_len = resp_len - (i + j) % 4
            response_ids.append(torch.randint(4, len(tok), (r_len,), generator=g).tolist())
            prompt_ids.append(p)
            adv.append([float((-1) ** (i + j))] * r_len)
    return pa.table(
        {
            "prompt_ids": pa.array(prompt_ids, type=pa.list_(pa.int64())),
            "response_ids": pa.array(response_ids, type=pa.list_(pa.int64())),
            "advantages": pa.array(adv, type=pa.list_(pa.float32())),
        }
    )


def test_actor_worker_update_on_device_matches_cpu(tiny_dir, record):
    """The real worker path: ActorWorker.compute_log_prob + update_actor on the device vs on cpu."""
    from dapo_core.compute.workers.actor import ActorWorker

    tok = load_tokenizer(tiny_dir)
    cfg = {
        **ACTOR,
        "strategy": "torch",
        "optim": dict(OPTIM),
        "ppo_mini_batch_size": 2,
        "ppo_micro_batch_size_per_gpu": 2,
        "ppo_epochs": 2,
        "shuffle": True,
        "grad_clip": 1.0,
        "use_kl_loss": False,
        "policy_loss": {"loss_mode": "vanilla"},
    }
    results = {}
    for where in dict.fromkeys(["cpu", DEV]):
        actor = ActorWorker(
            str(tiny_dir),
            cfg,
            pad_token_id=tok.pad_token_id,
            temperature=1.0,
            rollout_n=2,
            total_steps=3,
            device=where,
            seed=0,
        )
        table = _actor_table(tok)
        losses = []
        try:
            for step in range(3):
                table = actor.compute_log_prob(table, calculate_entropy=True)
                losses.append(actor.update_actor(table, step)["actor/pg_loss"])
        except RuntimeError as e:
            record(f"actor_worker[{where}]", {"error": str(e).splitlines()[0][:300]})
            pytest.fail(f"ActorWorker on {where} failed: {str(e).splitlines()[0][:300]}")
        results[where] = losses
    record("actor_worker_pg_loss", results)
    np.testing.assert_allclose(results[DEV], results["cpu"], atol=LOSS_ATOL, rtol=0)


# --------------------------------------------------------------------------- (d) throughput
def _throughput(model_dir, *, dtype, batch, new_tokens, greedy, prompts):
    eng = HFRolloutEngine(model_dir, device=DEV, dtype=dtype, max_batch_size=batch, progress=False)
    rows = (prompts * (batch // len(prompts) + 1))[:batch]
    params = SamplingParams(max_new_tokens=new_tokens, do_sample=not greedy, temperature=1.0)
    seeds = list(range(batch))
    eng.generate(rows[:batch], SamplingParams(max_new_tokens=4, do_sample=not greedy), seeds)  # warm-up
    _sync()
    t0 = time.perf_counter()
    out = eng.generate(rows, params, seeds)
    _sync()
    dt = time.perf_counter() - t0
    eng.close()
    tokens = sum(len(c.token_ids) for c in out)
    return {
        "tokens": tokens,
        "seconds": round(dt, 4),
        "tok_per_s": round(tokens / dt, 1),
        "steps_per_s": round(max(len(c.token_ids) for c in out) / dt, 1),
    }


def test_hf_generation_throughput(bigger_dir, record):
    tok = load_tokenizer(bigger_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    if DEV == "cuda":
        grid = [
            (dt, b, g) for dt in (torch.float32, torch.bfloat16) for b in (64, 256) for g in (False, True)
        ]
        new_tokens = 128
    else:  # dry run: one small configuration
        grid, new_tokens = [(torch.float32, 4, False)], 8
    n_params = None
    lines, results = [], {}
    for dtype, b, greedy in grid:
        r = _throughput(
            bigger_dir, dtype=dtype, batch=b, new_tokens=new_tokens, greedy=greedy, prompts=prompts
        )
        key = f"{str(dtype).removeprefix('torch.')}-B{b}-{'greedy' if greedy else 'sampled'}"
        results[key] = r
        lines.append(
            f"  {key:<24} {r['tok_per_s']:>10.1f} tok/s  ({r['tokens']} tokens in {r['seconds']:.3f} s)"
        )
        assert r["tokens"] > 0
    if n_params is None:
        from dapo_core.compute.models import load_model

        n_params = sum(p.numel() for p in load_model(bigger_dir).parameters())
    header = (
        f"HF rollout throughput on {DEV} ({torch.cuda.get_device_name(0) if DEV == 'cuda' else 'cpu'}), "
        f"model hidden 512 / 4 layers / {n_params / 1e6:.1f} M params, max_new_tokens={new_tokens}:"
    )
    print("\n" + header + "\n" + "\n".join(lines))
    record("throughput", {"params": n_params, "max_new_tokens": new_tokens, **results})


# --------------------------------------------------------------------------- (c) DeepSpeed ZeRO-2 on cuda
def _deepspeed_or_skip():
    try:
        import deepspeed
    except Exception as e:
        pytest.skip(
            f"deepspeed is not importable here ({type(e).__name__}: {str(e)[:160]}); carry its wheel and "
            "pydantic/hjson (bench/gpu_check.sh installs build/gpu_wheels/*.whl) to run this test"
        )
    return deepspeed


@pytest.mark.timeout(150, method="thread")  # an NCCL hang must not eat the whole run; last test
def test_deepspeed_zero2_matches_torch(tiny_dir, record):
    ds_mod = _deepspeed_or_skip()
    batch = _make_batch(seed=2)
    t0 = time.perf_counter()
    ref_rows, ref_w = _trajectory(tiny_dir, DEV, batch, steps=3)
    ds_rows, ds_w = _trajectory(
        tiny_dir, DEV, batch, steps=3, strategy="deepspeed", deepspeed_cfg={"zero_stage": 2}
    )
    loss_r, loss_d = _series(ref_rows, "actor/pg_loss"), _series(ds_rows, "actor/pg_loss")
    info = {
        "device": DEV,
        "deepspeed": ds_mod.__version__,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "pg_loss_torch": loss_r.tolist(),
        "pg_loss_deepspeed": loss_d.tolist(),
        "grad_norm_torch": _series(ref_rows, "actor/grad_norm").tolist(),
        "grad_norm_deepspeed": _series(ds_rows, "actor/grad_norm").tolist(),
        "max_weight_diff": _max_diff(ref_w, ds_w),
        "seconds": time.perf_counter() - t0,
    }
    record("deepspeed_zero2", info)
    if DEV == "cuda":
        assert info["backend"] == "nccl"
    np.testing.assert_allclose(loss_d, loss_r, atol=DS_ATOL, rtol=0)
    np.testing.assert_allclose(info["grad_norm_deepspeed"], info["grad_norm_torch"], rtol=GRAD_NORM_RTOL)
    assert info["max_weight_diff"] <= WEIGHT_ATOL
