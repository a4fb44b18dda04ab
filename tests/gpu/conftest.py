"""Fixtures for the GPU tests (`-m gpu`): the device under test, tiny models and a results recorder.

The GPU tests run on `cuda` when it is available and are skipped otherwise. For a dry run of the test
logic on a CPU-only machine set `DAPO_GPU_TESTS_ON_CPU=1`: the same tests then run with `cpu` standing
in for `cuda` (cuda-vs-cpu comparisons become cpu-vs-cpu; the DeepSpeed test runs on gloo when deepspeed
is installed).

Everything imported here and in `test_gpu_engines.py` exists on the GPU machine's stock image (torch,
transformers, tokenizers, safetensors, numpy, pyarrow, tqdm, pytest): only `dapo_core.compute.engines`,
`dapo_core.compute.models`, `dapo_core.algo.losses.core`, `dapo_core.algo.kl`, `dapo_core.data.batch` and
`dapo_core.compute.workers.actor` are imported, never the CLI / flows / config modules (omegaconf, pandera,
prefect, ray are absent there). DeepSpeed is imported lazily inside its test and skipped when missing.

Results (worst log-prob gaps, loss trajectories, throughput) are collected by the `record` fixture and
written as JSON to `$DAPO_GPU_RESULTS` (when set) after each result and at the end of the session.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dapo_core.compute.models import build_tiny_model
from tests.helpers import tiny_model_cfg

ON_CPU_DRY_RUN = os.environ.get("DAPO_GPU_TESTS_ON_CPU") == "1"
DEVICE: str | None = "cuda" if torch.cuda.is_available() else ("cpu" if ON_CPU_DRY_RUN else None)

TINY = tiny_model_cfg()
"""The small model for the numerics tests (fast on CPU, so the CPU reference side stays cheap)."""

BIGGER = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
"""A "larger tiny" model (hidden 512, 4 layers, GQA 8/2, ~13 M parameters) for log-probs and throughput."""

_RESULTS: dict[str, object] = {}


def _pin_fp32_matmul() -> None:
    """Keep float32 matmuls in IEEE float32 (no TF32) so cuda and cpu numerics are comparable.

    PyTorch's default already is "highest"; only the stable `set_float32_matmul_precision` API is used
    (mixing the legacy `allow_tf32` flags with torch >= 2.9's `fp32_precision` ones can raise).
    """
    if torch.get_float32_matmul_precision() != "highest":
        torch.set_float32_matmul_precision("highest")


def pytest_configure(config: pytest.Config) -> None:
    _pin_fp32_matmul()
    # DeepSpeed picks its accelerator at import time; name it instead of letting it probe.
    if torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cuda")


@pytest.fixture(scope="session")
def device() -> str:
    if DEVICE is None:  # the module-level skipif already covers this; belt and braces
        pytest.skip("needs a CUDA GPU (set DAPO_GPU_TESTS_ON_CPU=1 to dry-run on CPU)")
    return DEVICE


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gpu_tiny"), TINY, seed=3)


@pytest.fixture(scope="session")
def bigger_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gpu_bigger"), BIGGER, seed=4)


def _write_results() -> None:
    out = os.environ.get("DAPO_GPU_RESULTS")
    if not out or not _RESULTS:
        return
    meta: dict[str, object] = {
        "torch": torch.__version__,
        "device": DEVICE,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name(0)
        meta["cuda"] = torch.version.cuda
    Path(out).write_text(json.dumps({"meta": meta, **_RESULTS}, indent=2, sort_keys=True))


@pytest.fixture(scope="session")
def record():
    """`record(key, value)` stores a JSON-serialisable result and rewrites `$DAPO_GPU_RESULTS` at once
    (so results survive a test that has to be killed by pytest-timeout's thread method)."""

    def _record(key: str, value: object) -> None:
        _RESULTS[key] = value
        print(f"[gpu-result] {key} = {json.dumps(value)}")
        _write_results()

    return _record


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write_results()
