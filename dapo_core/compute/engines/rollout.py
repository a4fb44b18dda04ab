"""Rollout engine interface: what every generator (HF, vLLM) offers the rollout worker.

A rollout engine turns token-id prompts into sampled completions and reports, for every sampled
token, its log-probability under the *raw* logits divided by the temperature (no top-p / top-k
renormalisation). That is exactly the quantity the training engine recomputes teacher-forced, so the
two can be compared token by token (rollout correction, off-policy diagnostics).

Each row of a `generate` call is one sample: the caller repeats a prompt `n` times and passes one
seed per row (`dapo_core.seeding.request_seed`). An engine must make a row's tokens depend only on
(prompt, params, seed, weights) — never on which other rows share the batch.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch

__all__ = [
    "ROLLOUT_ENGINES",
    "Completion",
    "RolloutEngine",
    "SamplingParams",
    "SamplingParamsError",
    "make_rollout_engine",
]


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and the fix."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion per row."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0) disables it."""
    max_new_tokens: int = 512
    """Maximum number of generated tokens per row (EOS included)."""
    do_sample: bool = True
    """False forces greedy decoding whatever the temperature."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SamplingParamsError(
                f"SamplingParams.temperature={self.temperature} is negative; use 0 for greedy or a value > 0."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(
                f"SamplingParams.top_p={self.top_p} must be in (0, 1]; use 1.0 to disable it."
            )
        if self.top_k < -1:
            raise SamplingParamsError(
                f"SamplingParams.top_k={self.top_k} must be -1 (off), 0 (off) or a positive count."
            )
        if self.max_new_tokens < 1:
            raise SamplingParamsError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1.")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax token (do_sample False or temperature 0)."""
        return (not self.do_sample) or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature log-probs are computed at: the sampling temperature, or 1.0 when greedy."""
        return 1.0 if self.greedy else float(self.temperature)


@dataclass
class Completion:
    """One sampled response: its tokens (EOS included when it stopped), per-token log-probs, and why it
    ended."""

    token_ids: list[int]
    """Generated token ids; the EOS token is the last one when finish_reason == "stop"."""
    log_probs: list[float]
    """log softmax(raw_logits / T)[token] for each generated token (same length as token_ids)."""
    finish_reason: str
    """"stop" (EOS sampled) or "length" (max_new_tokens reached)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific information (never needed by callers)."""


class RolloutEngine(abc.ABC):
    """Abstract generator. Implementations: `HFRolloutEngine` (hf), `VLLMRolloutEngine` (vllm)."""

    def __init__(self) -> None:
        self._weight_version = 0

    @abc.abstractmethod
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> list[Completion]:
        """Sample one completion per prompt row; `seeds[i]` alone determines row i's randomness."""

    @abc.abstractmethod
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights (HF parameter names) from the trainer in place; bumps `weight_version`."""

    @abc.abstractmethod
    def load_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], max_message_bytes: int | None = None
    ) -> None:
        """Copy these weights in place as they come (part of a push: the version is not bumped); an engine
        that forwards them to other processes sends at most `max_message_bytes` at a time (one tensor
        larger than that goes alone)."""

    @abc.abstractmethod
    def weight_names(self) -> set[str]:
        """The HF parameter names a push must cover."""

    @property
    @abc.abstractmethod
    def weight_dtype(self) -> str:
        """The dtype the engine holds its weights in (what a push sends), e.g. `bfloat16`."""

    @abc.abstractmethod
    def load_weights_from(self, path: str | Path) -> None:
        """Reload all weights from an HF folder (safetensors); bumps `weight_version`."""

    @property
    def weight_version(self) -> int:
        """How many times weights were synced / loaded since construction (0 = as built)."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        self._weight_version = int(value)

    def close(self) -> None:
        """Release resources (processes, memory). Safe to call twice. The base class holds none."""
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ROLLOUT_ENGINES: dict[str, str] = {
    "hf": "dapo_core.compute.engines.hf_rollout:HFRolloutEngine",
    "vllm": "dapo_core.compute.engines.vllm_rollout:VLLMRolloutEngine",
}
"""Engine name -> "module:Class"; imported lazily so vLLM is only needed when asked for."""


def check_generate_args(prompt_ids: list[list[int]], seeds: list[int]) -> None:
    """Validate the common `generate` arguments; raises ValueError naming the field."""
    if len(prompt_ids) != len(seeds):
        raise ValueError(
            f"generate: len(seeds)={len(seeds)} != len(prompt_ids)={len(prompt_ids)}; pass one seed per row "
            "(dapo_core.seeding.request_seed)."
        )
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(
                f"generate: prompt_ids[{i}] is empty; every row needs at least one prompt token."
            )


def make_rollout_engine(
    name: str, model_path: str | Path, *, device: str = "cpu", seed: int = 0, **opts: Any
) -> RolloutEngine:
    """Build the rollout engine called `name` ("hf" or "vllm") on the HF folder `model_path`.

    `opts` are passed to the engine class (e.g. `max_batch_size`, `progress` for hf;
    `gpu_memory_utilization`, `tensor_model_parallel_size`, `enforce_eager` for vllm).
    """
    if name not in ROLLOUT_ENGINES:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={name!r} is unknown; choose one of {sorted(ROLLOUT_ENGINES)}."
        )
    module_name, cls_name = ROLLOUT_ENGINES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"rollout engine {name!r} needs {module_name} and its dependencies ({e}); install them or set "
            "actor_rollout_ref.rollout.name=hf."
        ) from e
    cls = getattr(module, cls_name)
    return cls(model_path, device=device, seed=seed, **opts)
