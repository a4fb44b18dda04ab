"""Worker-side checks about the user's input raise the project's user error.

A prompt + response longer than the model's positions is refused by the preflight; if it still reaches a
rollout engine (a prompt longer than `data.max_prompt_length` was let through, an engine built with a
smaller `max_model_len`), the engine's refusal must be a `DapoUserError` naming the fields and the fix, so
that the CLI prints one paragraph instead of a Ray traceback of a plain `ValueError`.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.models import build_tiny_model
from dapo_core.errors import DapoUserError, find_user_error
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)


class _RayTaskErrorLike(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__("ray::RolloutWorker.generate() failed")
        self.cause = cause


def _assert_one_paragraph(err: BaseException, limit: int) -> None:
    assert isinstance(err, DapoUserError) and isinstance(err, ValueError)  # `except ValueError` still works
    msg = str(err)
    assert "\n" not in msg
    for part in ("data.max_prompt_length", "data.max_response_length", f"={limit}", "Fix:", "config.json"):
        assert part in msg, (part, msg)
    wrapped = RuntimeError("Flow run encountered an exception")
    wrapped.__cause__ = _RayTaskErrorLike(err)
    assert find_user_error(wrapped) is err


def test_hf_engine_positions_overflow_is_a_user_error(tmp_path):
    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine

    model = build_tiny_model(tmp_path / "m", tiny_model_cfg(hidden_size=32, max_position_embeddings=64), 0)
    engine = HFRolloutEngine(model, max_batch_size=2, progress=False)
    with pytest.raises(DapoUserError) as exc:
        engine.generate([[5] * 10], SamplingParams(max_new_tokens=60), [1])
    _assert_one_paragraph(exc.value, 64)
    assert "max_position_embeddings=64" in str(exc.value) and "10 tokens + 60 new tokens" in str(exc.value)


def test_vllm_engine_positions_overflow_is_a_user_error(monkeypatch, tmp_path):
    """The check runs before vLLM is used: an engine object without a running vLLM reaches it."""
    from dapo_core.compute.engines.vllm_rollout import VLLMRolloutEngine

    vllm = types.ModuleType("vllm")
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    engine = object.__new__(VLLMRolloutEngine)
    engine.model_path = tmp_path
    engine._asleep = False
    engine.max_positions = 128
    engine.max_model_len = 48
    with pytest.raises(DapoUserError) as exc:
        engine.generate([[5] * 8], SamplingParams(max_new_tokens=41), [1])
    _assert_one_paragraph(exc.value, 48)
    assert "max_model_len=48" in str(exc.value) and "max_position_embeddings=128" in str(exc.value)
