"""Tests for the rollout interface and HFRolloutEngine (determinism, log-probs, stopping, weight sync), and
the rollout keys that reach it through a run (`max_num_seqs`, `dtype`)."""

from __future__ import annotations

import re

import pytest
import torch

from dapo_core.compute.engines.hf_rollout import HFRolloutEngine, filter_logits
from dapo_core.compute.engines.rollout import SamplingParams, SamplingParamsError, make_rollout_engine
from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.models import build_tiny_model, load_tokenizer
from dapo_core.config import ConfigError, load_config, typed
from tests.helpers import in_process_run_overrides, tiny_model_cfg

torch.set_num_threads(1)

TINY = tiny_model_cfg(hidden_size=32, intermediate_size=64, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TINY, seed=0)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return make_rollout_engine("hf", tiny_dir, max_batch_size=16, progress=False)


@pytest.fixture(scope="module")
def prompts(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    texts = ["1+1=", "What is the answer to life?", "x", "Hello\nworld", "12*12="]
    return [tok.encode(t) for t in texts]


def _teacher_forced(tiny_dir, prompts, completions, temperature):
    p = max(len(x) for x in prompts)
    length = max(len(c.token_ids) for c in completions)
    b = len(prompts)
    ids = torch.zeros(b, p + length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (x, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, p - len(x) : p] = torch.tensor(x)
        ids[i, p : p + len(c.token_ids)] = torch.tensor(c.token_ids)
        mask[i, p - len(x) : p + len(c.token_ids)] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    train = make_train_engine("torch", tiny_dir, {"lr": 1e-3}, total_steps=1, grad_clip=1.0)
    train.eval()
    log_probs, _ = train.forward(ids, mask, pos, length, temperature=temperature)
    return log_probs


def test_same_seeds_same_tokens_and_seed_matters(engine, prompts):
    sp = SamplingParams(max_new_tokens=12)
    seeds = [10, 11, 12, 13, 14]
    a = engine.generate(prompts, sp, seeds)
    b = engine.generate(prompts, sp, seeds)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.log_probs for c in a] == [c.log_probs for c in b]
    c = engine.generate(prompts, sp, [s + 100 for s in seeds])
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    for x in a:
        assert len(x.token_ids) == len(x.log_probs) <= 12
        assert x.finish_reason in ("stop", "length")


def test_row_tokens_do_not_depend_on_batch(engine, prompts, tiny_dir):
    sp = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=50)
    seeds = [7, 8, 9, 10, 11]
    together = engine.generate(prompts, sp, seeds)
    alone = [engine.generate([p], sp, [s])[0] for p, s in zip(prompts, seeds, strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    # Micro-batching of a long request list does not change anything either.
    small = HFRolloutEngine(tiny_dir, max_batch_size=2, progress=False)
    again = small.generate(prompts[::-1], sp, seeds[::-1])[::-1]
    assert [c.token_ids for c in together] == [c.token_ids for c in again]
    for x, y in zip(together, again, strict=True):
        assert max(abs(u - v) for u, v in zip(x.log_probs, y.log_probs, strict=True)) <= 1e-5


def test_group_rows_share_the_prefill_but_not_their_samples(engine, prompts):
    # The n samples of a group (equal prompts) get one prefill; each row still samples from its own seed,
    # exactly as when it is generated alone, and the group's rows differ from one another.
    sp = SamplingParams(max_new_tokens=14, temperature=0.9)
    group = [prompts[1]] * 6 + [prompts[3]] * 6
    seeds = list(range(40, 52))
    together = engine.generate(group, sp, seeds)
    alone = [engine.generate([p], sp, [s])[0] for p, s in zip(group, seeds, strict=True)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for x, y in zip(together, alone, strict=True):
        assert max(abs(u - v) for u, v in zip(x.log_probs, y.log_probs, strict=True)) <= 1e-5
    assert len({tuple(c.token_ids) for c in together[:6]}) > 1


def test_the_lm_head_sees_one_position_per_row_in_the_prefill(tiny_dir, prompts):
    # Only the last prompt position's logits are sampled from, so the prefill runs the LM head on it alone
    # (at a 49 k vocabulary the full-length logits are a fifth of the prefill's FLOPs and its largest tensor).
    eng = make_rollout_engine("hf", tiny_dir, max_batch_size=16, progress=False)
    widths: list[int] = []
    hook = eng.model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: widths.append(int(args[0].shape[1]))
    )
    try:
        eng.generate(prompts, SamplingParams(max_new_tokens=3, temperature=1.0), list(range(len(prompts))))
    finally:
        hook.remove()
    assert widths == [1, 1, 1]  # the prefill and two decode steps


def test_a_rows_stream_does_not_depend_on_max_new_tokens(tiny_dir, prompts):
    # Variates are drawn in blocks of steps; the block size follows max_new_tokens, the stream must not.
    engine = HFRolloutEngine(tiny_dir, max_batch_size=16, progress=False, eos_token_id=-1)
    seeds = [3, 4, 5, 6, 7]
    short = engine.generate(prompts, SamplingParams(max_new_tokens=5), seeds)
    long = engine.generate(prompts, SamplingParams(max_new_tokens=23), seeds)
    for s, g in zip(short, long, strict=True):
        assert len(g.token_ids) == 23
        assert g.token_ids[:5] == s.token_ids


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_log_probs_match_teacher_forced_train_forward(engine, prompts, tiny_dir, temperature, top_p):
    sp = SamplingParams(max_new_tokens=20, temperature=temperature, top_p=top_p)
    completions = engine.generate(prompts, sp, [1, 2, 3, 4, 5])
    recomputed = _teacher_forced(tiny_dir, prompts, completions, temperature)
    worst = 0.0
    for i, c in enumerate(completions):
        got = torch.tensor(c.log_probs, dtype=torch.float32)
        worst = max(worst, float((got - recomputed[i, : len(got)]).abs().max()))
    assert worst <= 1e-5


def test_greedy_ignores_seed_and_top_k_1_is_greedy(engine, prompts):
    greedy = SamplingParams(max_new_tokens=10, do_sample=False)
    a = engine.generate(prompts, greedy, [1, 2, 3, 4, 5])
    b = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0), [9, 9, 9, 9, 9])
    c = engine.generate(prompts, SamplingParams(max_new_tokens=10, top_k=1), [5, 6, 7, 8, 9])
    assert [x.token_ids for x in a] == [x.token_ids for x in b] == [x.token_ids for x in c]


def test_stops_at_eos_and_includes_it(tiny_dir, prompts, engine):
    first = engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, do_sample=False), [0])[0].token_ids[
        0
    ]
    stopper = HFRolloutEngine(tiny_dir, eos_token_id=first, progress=False)
    out = stopper.generate(prompts[:1] * 2, SamplingParams(max_new_tokens=8, do_sample=False), [0, 1])
    for c in out:
        assert c.token_ids == [first] and c.finish_reason == "stop" and len(c.log_probs) == 1
    long = engine.generate(prompts[:1], SamplingParams(max_new_tokens=3, do_sample=False), [0])[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 3


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, top_k=-1, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, top_k=-1, top_p=0.81))
    assert kept.tolist() == [[True, True, True, False]]
    kept = torch.isfinite(filter_logits(logits, top_k=-1, top_p=0.1))  # the best token always stays
    assert kept.tolist() == [[True, False, False, False]]


def test_sampling_follows_the_distribution(engine, prompts):
    # Empirical first-token frequencies over many seeds match softmax(logits / T) restricted to top-k.
    sp = SamplingParams(max_new_tokens=1, temperature=2.0, top_k=3)
    n = 600
    out = engine.generate(prompts[:1] * n, sp, list(range(n)))
    model = engine.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompts[0]])).logits[0, -1] / 2.0
    top = torch.topk(logits, 3)
    probs = torch.softmax(top.values, -1)
    counts = torch.zeros(3)
    for c in out:
        tok = c.token_ids[0]
        assert tok in top.indices.tolist()
        counts[top.indices.tolist().index(tok)] += 1
    assert torch.allclose(counts / n, probs, atol=0.07)


def test_sync_weights_and_load_weights_from(tiny_dir, prompts, tmp_path):
    eng = HFRolloutEngine(tiny_dir, progress=False)
    sp = SamplingParams(max_new_tokens=6, do_sample=False)
    before = eng.generate(prompts, sp, [0] * 5)
    original = {k: v.clone() for k, v in eng.model.state_dict().items()}
    assert eng.weight_version == 0
    eng.sync_weights((f"module.{k}", v * 1.5) for k, v in original.items())
    assert eng.weight_version == 1
    assert torch.equal(eng.model.state_dict()["model.norm.weight"], original["model.norm.weight"] * 1.5)
    assert eng.generate(prompts, sp, [0] * 5) != before
    eng.load_weights_from(tiny_dir, version=7)
    assert eng.weight_version == 7
    assert [c.token_ids for c in eng.generate(prompts, sp, [0] * 5)] == [c.token_ids for c in before]
    with pytest.raises(KeyError, match="not_a_param"):
        eng.sync_weights([("not_a_param", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        eng.sync_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(FileNotFoundError):
        eng.load_weights_from(tmp_path)


def test_an_engine_started_on_unset_weights_generates_as_loaded_after_a_push(engine, tiny_dir, prompts):
    """`dummy_weights`: nothing is read from disk; one push of the actor's tensors (tied ones once) makes
    it the loaded engine, token for token, and the tie holds."""
    dummy = HFRolloutEngine(tiny_dir, progress=False, dummy_weights=True)
    assert dummy.weight_names() == engine.weight_names()
    trainer = make_train_engine("torch", tiny_dir, {"lr": 1e-3}, total_steps=1, grad_clip=None)
    sent = [(n, t) for n, t in trainer.iter_sync_tensors() if not isinstance(t, str)]
    assert len(sent) < len(engine.weight_names())  # the tied lm_head is an alias, not sent
    dummy.load_tensors(iter(sent))
    sp = SamplingParams(max_new_tokens=8, do_sample=False)
    want = [c.token_ids for c in engine.generate(prompts, sp, [0] * len(prompts))]
    assert [c.token_ids for c in dummy.generate(prompts, sp, [0] * len(prompts))] == want
    head, embed = dummy.model.get_output_embeddings().weight, dummy.model.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr()


def test_argument_errors(engine, prompts):
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="seeds"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2), [1])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams(max_new_tokens=2), [1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=1000), [1])
    with pytest.raises(ValueError, match=re.escape("rollout.name")):
        make_rollout_engine("sglang", "/nonexistent")


def test_reserved_kv_cache_gives_bitwise_the_growing_caches_tokens(tiny_dir, prompts, monkeypatch):
    """Without the shared-prompt cache (SDPA decode steps) the engine writes the KV cache into a buffer
    reserved for the whole generation instead of growing it by concatenation; attention reads the same
    numbers, so tokens and log-probs are bitwise equal, also while rows end at different steps and leave the
    cache."""
    import transformers

    import dapo_core.compute.engines.hf_rollout as hf

    engine = HFRolloutEngine(tiny_dir, max_batch_size=64, progress=False, decode_attention=False)
    group = [p for p in prompts for _ in range(8)]
    sp = SamplingParams(max_new_tokens=40, temperature=1.3)
    seeds = list(range(len(group)))
    cache = hf.reserved_cache(engine.model.config, 8)
    assert all(isinstance(layer, hf._ReservedLayer) for layer in cache.layers)
    reserved = engine.generate(group, sp, seeds)
    monkeypatch.setattr(
        hf, "reserved_cache", lambda config, capacity: transformers.DynamicCache(config=config)
    )
    growing = engine.generate(group, sp, seeds)
    assert [c.token_ids for c in reserved] == [c.token_ids for c in growing]
    assert [c.log_probs for c in reserved] == [c.log_probs for c in growing]
    lengths = {len(c.token_ids) for c in reserved}
    assert len(lengths) > 1 and any(c.finish_reason == "stop" for c in reserved)  # rows left the cache early


def test_finished_rows_leave_the_cache_in_batches_without_changing_any_row(tiny_dir, prompts, monkeypatch):
    """Finished rows stay in the batch until they are `compact_fraction` of it. Compacting at every finished
    row (0), at a quarter (the default) or never (1) gives the same tokens, finish reasons and log-probs (to
    float32 rounding: the matmuls see another row count), and the default copies the cache fewer times."""
    from dapo_core.compute.engines.decode_attention import SharedPrefixCache

    group = [p for p in prompts for _ in range(8)]
    sp = SamplingParams(max_new_tokens=80, temperature=1.3)
    seeds = list(range(len(group)))
    calls: list[int] = []
    select = SharedPrefixCache.batch_select_indices

    def counted(self, indices):
        calls.append(int(indices.numel()))
        return select(self, indices)

    monkeypatch.setattr(SharedPrefixCache, "batch_select_indices", counted)
    outs, compactions = {}, {}
    for fraction in (0.0, 0.25, 1.0):
        calls.clear()
        engine = HFRolloutEngine(tiny_dir, max_batch_size=64, compact_fraction=fraction, progress=False)
        outs[fraction] = engine.generate(group, sp, seeds)
        compactions[fraction] = len(calls)
    assert any(c.finish_reason == "stop" for c in outs[0.0])
    assert len({len(c.token_ids) for c in outs[0.0]}) > 1  # rows end at different steps
    for fraction in (0.25, 1.0):
        assert [c.token_ids for c in outs[fraction]] == [c.token_ids for c in outs[0.0]]
        assert [c.finish_reason for c in outs[fraction]] == [c.finish_reason for c in outs[0.0]]
        for x, y in zip(outs[fraction], outs[0.0], strict=True):
            assert max(abs(u - v) for u, v in zip(x.log_probs, y.log_probs, strict=True)) <= 1e-5
    # the rows of a prompt share its cache, so the prefill copies nothing: only compactions select rows
    assert 0 == compactions[1.0] < compactions[0.25] < compactions[0.0]
    with pytest.raises(ValueError, match="compact_fraction"):
        HFRolloutEngine(tiny_dir, compact_fraction=1.5, progress=False)


# ----------------------------------------------------------------------------------------------------------
# `actor_rollout_ref.rollout.max_num_seqs` reaches the engines: the hf engine decodes that many rows per
# forward (the CPU default's 512-row generation batches run as one forward per token instead of eight), and a
# row's tokens do not depend on how the request list is cut.


def test_max_num_seqs_sets_the_hf_engines_rows_per_forward_without_changing_a_rows_tokens(tmp_path):
    from flows.run_setup import close_run, open_run

    torch.set_num_threads(1)
    base = in_process_run_overrides(tmp_path)
    outs = {}
    for seqs in (3, 1024):
        cfg = typed(
            load_config(
                "configs/tiny_cpu.yaml",
                [
                    *base,
                    f"trainer.runs_dir={tmp_path / f'runs{seqs}'}",
                    f"actor_rollout_ref.rollout.max_num_seqs={seqs}",
                ],
            )
        )
        rt = open_run(cfg, f"seqs{seqs}")
        try:
            engine = rt.rollout.workers[
                0
            ]._handle.local.engine  # the in-process worker behind replica 0's proxy
            assert engine.max_batch_size == seqs
            prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8], [12, 13, 14, 15, 16]] * 2
            outs[seqs] = engine.generate(prompts, SamplingParams(max_new_tokens=6), list(range(8)))
        finally:
            close_run(rt)
    assert [c.token_ids for c in outs[3]] == [c.token_ids for c in outs[1024]]


# ----------------------------------------------------------------------------------------------------------
# `actor_rollout_ref.rollout.dtype` reaches the hf engine: bfloat16 loads the rollout model in bfloat16
# (what verl's vLLM rollout serves on GPUs), `auto` keeps float32, and the sampled tokens' log-probs stay
# close to the float32 trainer's teacher-forced ones.


def test_rollout_dtype_sets_the_hf_engines_model_precision(tmp_path):
    from flows.run_setup import close_run, open_run

    torch.set_num_threads(1)
    base = in_process_run_overrides(tmp_path)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    outs = {}
    for dtype, expected in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):
        overrides = [
            *base,
            f"trainer.runs_dir={tmp_path / f'runs_{dtype}'}",
            f"actor_rollout_ref.rollout.dtype={dtype}",
        ]
        cfg = typed(load_config("configs/tiny_cpu.yaml", overrides))
        rt = open_run(cfg, f"dtype-{dtype}")
        try:
            engine = rt.rollout.workers[0]._handle.local.engine  # the in-process worker behind the proxy
            assert engine.model.dtype == expected
            greedy = SamplingParams(max_new_tokens=6, do_sample=False)
            outs[dtype] = engine.generate(prompts, greedy, [0, 1, 2])
        finally:
            close_run(rt)
    # Greedy decoding from the same weights: bfloat16 rounding may flip a near tie, but the log-probs of the
    # tokens both precisions chose agree to bfloat16 precision.
    for a, b in zip(outs["auto"], outs["bfloat16"], strict=True):
        same = 0
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.log_probs, b.log_probs, strict=False):
            if ta != tb:
                break
            same += 1
            assert abs(la - lb) < 0.05
        assert same >= 1


def test_rollout_dtype_rejects_other_values(tmp_path):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.dtype"):
        load_config("configs/tiny_cpu.yaml", ["actor_rollout_ref.rollout.dtype=int8"])
    model = build_tiny_model(tmp_path / "model", tiny_model_cfg(num_hidden_layers=1), seed=0)
    with pytest.raises(ValueError, match=r"rollout\.dtype"):
        HFRolloutEngine(model, dtype="int8", progress=False)
