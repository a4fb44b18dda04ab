"""`actor_rollout_ref.rollout.dtype` reaches the hf engine: bfloat16 loads the rollout model in bfloat16 (what
verl's vLLM rollout serves on GPUs), `auto` keeps float32, and the sampled tokens' log-probs stay close to the
float32 trainer's teacher-forced ones."""

from __future__ import annotations

import pytest
import torch

from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.models import build_tiny_model
from dapo_core.config import ConfigError, load_config, typed
from tests.helpers import in_process_run_overrides, tiny_model_cfg


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
