"""bfloat16 against float32: the log-prob tolerance that lets the rollout and the actor run in bfloat16.

Δ is a token's log-prob in bfloat16 minus the float32 teacher-forced one of the same token. The tolerance
(docs/RESULTS.md, "bfloat16 on the real model", measured there on SmolLM2-135M): no token ratio exp(Δ) outside
the IS truncation [0.5, 2], and p99 |Δ| inside the PPO clip range (log 0.8, log 1.28) = (−0.22, 0.25), so the
mismatch alone clips ≤ 1 % of the tokens. It must hold for the HF rollout engine with bfloat16 weights and for
the torch training engine under autocast bfloat16 (with the LM head in bfloat16 or kept in float32); a float32
rollout must match the teacher-forced forward to 1e-4.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.logits import token_log_probs
from dapo_core.compute.models import build_tiny_model, load_model, load_tokenizer
from dapo_core.data.batch import to_padded
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

N = 4  # samples per prompt
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's clip range: a token ratio in [0.8, 1.28] is not clipped
P99_LIMIT = min(-math.log(1 - CLIP_LOW), math.log(1 + CLIP_HIGH))  # 0.223
RATIO_LIMIT = math.log(2)  # the IS truncation


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("bf16"), tiny_model_cfg(), seed=0)
    tok = load_tokenizer(folder)
    texts = ["What is 3 + 4?", "12*12=", "Hello\nworld", "x"]
    prompts = [tok.encode(t) for t in texts for _ in range(N)]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    rollouts = {}
    for dtype in ("float32", "bfloat16"):
        engine = HFRolloutEngine(folder, dtype=dtype, max_batch_size=len(prompts), seed=0, progress=False)
        rollouts[dtype] = engine.generate(prompts, params, list(range(len(prompts))))
        engine.close()
    return folder, prompts, rollouts


def _deltas(reference: list[torch.Tensor], other: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([o.float() - r.float() for r, o in zip(reference, other, strict=True)])


def _assert_within_tolerance(d: torch.Tensor) -> None:
    assert d.numel() > 0
    assert torch.isfinite(d).all()
    assert d.abs().max() > 0, "no difference from float32: the bfloat16 path did not run"
    assert d.abs().max() <= RATIO_LIMIT, f"a token ratio leaves [0.5, 2]: max |Δ| {d.abs().max():.4f}"
    p99 = float(d.abs().quantile(0.99))
    assert p99 < P99_LIMIT, f"p99 |Δ| {p99:.4f} outside the clip range ({P99_LIMIT:.3f})"


def _teacher_forced(folder, prompts, responses) -> list[torch.Tensor]:
    """float32 per-token log-probs of `responses` after `prompts`, one row at a time (no padding)."""
    model = load_model(folder, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float()
            out.append(token_log_probs(logits, torch.tensor(r))[0])
    return out


def _float32_head(model) -> None:
    """Run the LM head outside autocast, on float32 hidden states."""
    head = model.get_output_embeddings()
    linear = head.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return linear(x.float())

    head.forward = forward


def _engine_log_probs(engine, batch: dict) -> list[torch.Tensor]:
    """Per-row response log-probs (valid tokens only) of the engine's eval-mode forward, one prompt's N rows
    per micro-batch through the shared-prompt path, as the actor computes them."""
    length = batch["responses"].shape[1]
    engine.eval()
    out = []
    for g in range(0, batch["input_ids"].shape[0], N):
        rows = {k: batch[k][g : g + N] for k in ("input_ids", "attention_mask", "position_ids")}
        lp, _ = engine.forward(**rows, response_length=length, share_prompt=True)
        out.extend(row[m.bool()] for row, m in zip(lp, batch["response_mask"][g : g + N], strict=True))
    return out


def test_rollout_bf16_log_probs_within_tolerance_of_float32(setup):
    folder, prompts, rollouts = setup
    for dtype, done in rollouts.items():
        reference = _teacher_forced(folder, prompts, [c.token_ids for c in done])
        d = _deltas(reference, [torch.tensor(c.log_probs) for c in done])
        if dtype == "float32":
            assert d.abs().max() < 1e-4, f"float32 rollout vs teacher forcing: {d.abs().max():.2e}"
        else:
            _assert_within_tolerance(d)


@pytest.mark.parametrize("head", ["bfloat16", "float32"])
def test_actor_autocast_bf16_log_probs_and_loss_within_tolerance(setup, head):
    folder, prompts, rollouts = setup
    responses = [c.token_ids for c in rollouts["float32"]]
    batch = to_padded(pa.table({"prompt_ids": prompts, "response_ids": responses}), 0)
    kwargs = {"total_steps": 1, "grad_clip": 1.0}
    fp32 = make_train_engine("torch", folder, {"lr": 1e-6}, **kwargs)
    bf16 = make_train_engine("torch", folder, {"lr": 1e-6}, compute_dtype=torch.bfloat16, **kwargs)
    if head == "float32":
        _float32_head(bf16.model)
    reference = _engine_log_probs(fp32, batch)
    lps = _engine_log_probs(bf16, batch)
    _assert_within_tolerance(_deltas(reference, lps))
    # the loss the update backpropagates (mean token log-prob) moves by less than the clip range allows
    loss32 = torch.cat(reference).mean()
    loss16 = torch.cat([x.float() for x in lps]).mean()
    assert abs(float(loss16 - loss32)) < P99_LIMIT * 0.1
