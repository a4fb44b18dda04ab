"""The vLLM-CPU engine on the real pretrained model: SmolLM2-135M-Instruct as `dapo import-model` writes it.

The folder comes from the main environment (`make test-vllm-cpu` imports it into `models/smollm2_135m`
first; `DAPO_REAL_MODEL` points elsewhere). The prompts are the real task's: word problems in the chat
template the training run uses. Checked against HF transformers on the same weights, in float32:
- greedy decoding gives the same tokens, and the engine's log-probs equal the teacher-forced recompute;
- after a training update (one AdamW step of the HF model), `sync_weights` makes vLLM's greedy output
  equal HF's on the new weights, and differ from the old output.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.models import load_model, load_tokenizer
from dapo_core.data.datasets import tokenize_prompt
from dapo_core.data.word_problems import make_word_problems
from tests.vllm_cpu.reference import assert_greedy_is_hf

pytest.importorskip(
    "vllm",
    reason="vllm is not installed: the vLLM-CPU tests run in .venv-vllm (make test-vllm-cpu / "
    "infra/setup_vllm_cpu_env.sh)",
)

pytestmark = pytest.mark.vllm_cpu

ROOT = Path(__file__).resolve().parents[2]

LOGPROB_TOL = 1e-3
"""Max |vLLM log-prob - teacher-forced log-prob| accepted on the real model in float32 (the tiny model's
tests use 1e-4; 30 layers and a 49 k vocabulary add rounding of the same order per layer)."""

GREEDY = SamplingParams(temperature=1.0, max_new_tokens=24, do_sample=False)


@pytest.fixture(scope="module")
def real_model_path() -> Path:
    path = Path(os.environ.get("DAPO_REAL_MODEL", ROOT / "models" / "smollm2_135m"))
    if not (path / "import.json").is_file():
        pytest.fail(
            f"{path} holds no imported model (no import.json). `make test-vllm-cpu` imports it first; by "
            f"hand: `.venv/bin/dapo import-model --out {path}` (or set DAPO_REAL_MODEL to such a folder)."
        )
    return path


@pytest.fixture(scope="module")
def prompts(real_model_path: Path) -> list[list[int]]:
    """Four word problems in the training run's chat format (two worked examples, then the question)."""
    tok = load_tokenizer(real_model_path)
    rows = make_word_problems(4, min_value=1, max_value=9, max_ops=3, ops=("+", "-"), seed=3)
    return [tokenize_prompt(tok, r["prompt"]) for r in rows]


@pytest.fixture(scope="module")
def hf_model(real_model_path: Path) -> torch.nn.Module:
    torch.set_num_threads(1)
    return load_model(real_model_path).eval()


@pytest.fixture(scope="module")
def eos(real_model_path: Path) -> int:
    return int(load_tokenizer(real_model_path).eos_token_id)


@pytest.fixture(scope="module")
def engine(real_model_path: Path):
    from dapo_core.compute.engines.rollout import make_rollout_engine

    e = make_rollout_engine(
        "vllm", real_model_path, device="cpu", seed=0, tensor_model_parallel_size=1, max_model_len=512
    )
    try:
        yield e
    finally:
        e.close()


def test_greedy_and_logprobs_equal_hf_on_the_real_model(engine, hf_model, prompts, eos):
    out = engine.generate(prompts, GREEDY, seeds=[0, 1, 2, 3])
    assert len({tuple(c.token_ids) for c in out}) > 1, "every problem got the same answer"
    assert_greedy_is_hf(hf_model, prompts, out, GREEDY.max_new_tokens, eos, LOGPROB_TOL)


def test_weight_sync_after_an_update_matches_hf(engine, hf_model, prompts, eos, real_model_path):
    before = engine.generate(prompts, GREEDY, seeds=[0, 1, 2, 3])
    updated = load_model(real_model_path)
    opt = torch.optim.AdamW(updated.parameters(), lr=1e-3)
    ids = torch.tensor([prompts[0] + before[1].token_ids])  # learn another problem's answer here
    updated(ids, labels=ids).loss.backward()
    opt.step()
    updated.eval()
    version = engine.weight_version
    engine.sync_weights((k, v.detach()) for k, v in updated.named_parameters())
    assert engine.weight_version == version + 1
    after = engine.generate(prompts, GREEDY, seeds=[0, 1, 2, 3])
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert_greedy_is_hf(updated, prompts, after, GREEDY.max_new_tokens, eos, LOGPROB_TOL)
