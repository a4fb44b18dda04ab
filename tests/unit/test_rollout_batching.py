"""`actor_rollout_ref.rollout.max_num_seqs` reaches the engines: the hf engine decodes that many rows per
forward (the CPU default's 512-row generation batches run as one forward per token instead of eight), and a
row's tokens do not depend on how the request list is cut."""

from __future__ import annotations

import torch

from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.config import load_config, typed
from tests.helpers import in_process_run_overrides


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
