"""LoRA adapters on a training engine's HF model, built with `peft` (verl's `actor_rollout_ref.model.lora_*`).

`add_lora` injects the adapters into the model in place (its modules gain `base_layer` / `lora_A` / `lora_B`
children) and freezes every other weight, so only the adapters get gradients and optimizer state;
`add_lora_on_meta` does the same to a model built on the meta device (the FSDP2 engine) and returns the
adapters' initial values, the ones `add_lora` would give from the same RNG state. The rest works on that
model, a sharded one too (`Shards`: a rank's rows and the gathers of a dim-0 sharded model; its gathers are
collectives, every rank calls in the same order):
- `merged_tensors`: the weights under the base model's own names (`hf_name`), each adapted linear weight
  merged as `W + B·A·lora_alpha/lora_rank` into a new tensor (the base weight is never modified), for a weight
  push and the HF export;
- `adapter_state` / `load_adapter_state`: the adapter tensors alone (a checkpoint's
  `adapter_model.safetensors`); `save_adapter`: the adapter-only export in peft's format
  (`adapter_config.json` + `adapter_model.safetensors`);
- `adapters_disabled`: the base model's forward (the reference policy) while the context is open.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapo_core.compute.weight_transport import distinct_tensors
from dapo_core.config import ConfigError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_SUBDIR",
    "ADAPTER_WEIGHTS",
    "LORA_STRATEGIES",
    "WHOLE",
    "LoraSpec",
    "Shards",
    "adapter_state",
    "adapters_disabled",
    "add_lora",
    "add_lora_on_meta",
    "check_strategy",
    "hf_name",
    "load_adapter_state",
    "merged_state_dict",
    "merged_tensors",
    "save_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config file name."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's adapter weights file name."""
ADAPTER_SUBDIR = "lora_adapter"
"""Sub-folder of an HF export (and checkpoint) holding the adapter-only export. Not the export folder
itself: transformers' `from_pretrained` applies an `adapter_config.json` it finds beside `model.safetensors`,
which would add the adapter a second time to the merged weights."""

_KEY = "actor_rollout_ref.model"

LORA_STRATEGIES = ("torch", "fsdp", "fsdp2", "deepspeed")
"""The `actor.strategy` values whose training engine builds adapters ("fsdp" is the torch engine's alias)."""


class Shards:
    """How a model's parameters are split over ranks, dim 0 each (FSDP2); this base class is the unsharded
    model, where a tensor is its own rows and its own whole."""

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the sharded tensor `t`."""
        return t

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of the sharded `t` (a gather)."""
        return t

    def full_from_local(self, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The whole tensor whose rows on each rank are that rank's `rows`, split as `like` (a gather)."""
        return rows

    def rows(self, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `whole`, a tensor split as `like`."""
        return whole


WHOLE = Shards()
"""The unsharded model's `Shards`."""


@dataclass(frozen=True)
class LoraSpec:
    """The adapters to build: `actor_rollout_ref.model`'s `lora_rank`, `lora_alpha`, `target_modules`,
    `exclude_modules` (verl's keys)."""

    rank: int
    """Adapter rank r (> 0)."""
    alpha: int
    """Scaling numerator: the update is B·A·alpha/r."""
    target_modules: str | tuple[str, ...] = "all-linear"
    """"all-linear" or module names (a name matches a module whose dotted path ends with it)."""
    exclude_modules: str | tuple[str, ...] | None = None
    """Module names (or one regex) left without adapters."""

    @classmethod
    def from_model_config(cls, model_cfg: Any) -> LoraSpec | None:
        """The spec of a `ModelConfig` (or a mapping with its keys); None when `lora_rank` is 0."""

        def get(key: str, default: Any) -> Any:
            if isinstance(model_cfg, Mapping):
                return model_cfg.get(key, default)
            return getattr(model_cfg, key, default)

        rank = int(get("lora_rank", 0) or 0)
        if rank <= 0:
            return None
        targets, excl = get("target_modules", "all-linear"), get("exclude_modules", None)
        return cls(
            rank=rank,
            alpha=int(get("lora_alpha", 16)),
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            exclude_modules=excl if excl is None or isinstance(excl, str) else tuple(excl),
        )

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor of B·A."""
        return self.alpha / self.rank


def check_strategy(strategy: str, spec: LoraSpec) -> None:
    """Refuse LoRA on a training engine that does not build adapters (not in `LORA_STRATEGIES`), in one
    paragraph naming the strategies that do."""
    if strategy not in LORA_STRATEGIES:
        raise ConfigError(
            f"{_KEY}.lora_rank={spec.rank} asks for LoRA adapters, which the {', '.join(LORA_STRATEGIES)} "
            f"training engines build and actor_rollout_ref.actor.strategy={strategy!r} does not",
            where="actor_rollout_ref.actor.strategy",
            fix="set actor_rollout_ref.actor.strategy=fsdp2 (sharded over the data-parallel ranks), "
            "strategy=deepspeed (ZeRO) or strategy=torch (one process, CPU or one GPU) for LoRA, or "
            "lora_rank=0 to train every weight with this strategy",
        )


def _linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _short_names(model: torch.nn.Module) -> list[str]:
    """The distinct last parts of the linear layers' names (q_proj, ..., lm_head)."""
    return sorted({n.rsplit(".", 1)[-1] for n in _linear_names(model)})


def _check_names(model: torch.nn.Module, spec: LoraSpec) -> None:
    """Refuse a listed target or excluded module name that matches no module of `model`."""
    modules = [n for n, _ in model.named_modules() if n]
    linear = _short_names(model)
    for key, names in (("target_modules", spec.target_modules), ("exclude_modules", spec.exclude_modules)):
        if names is None or names == "all-linear" or isinstance(names, str):
            continue
        unknown = [t for t in names if not any(m == t or m.endswith("." + t) for m in modules)]
        if unknown:
            raise ConfigError(
                f"{_KEY}.{key} names {unknown}, which match no module of the model",
                where=f"{_KEY}.{key}",
                fix=f"use module names of this model (its linear layers: {linear}), or all-linear for "
                "target_modules",
            )


def _matches(name: str, names: str | tuple[str, ...] | None) -> bool:
    """peft's module matching: a regex string matches the whole module path; a listed name matches a path
    equal to it or ending with `.name`."""
    if names is None:
        return False
    if isinstance(names, str):
        return re.fullmatch(names, name) is not None
    return any(name == n or name.endswith("." + n) for n in names)


def _shown(names: str | tuple[str, ...]) -> str:
    return names if isinstance(names, str) else f"[{', '.join(names)}]"


def _check_tied_head(model: torch.nn.Module, spec: LoraSpec) -> None:
    """Refuse an adapter on an LM head tied to the input embedding: its merged weight would differ from the
    embedding, which a tied model (the rollout's, the export's) cannot hold."""
    config = getattr(model, "config", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if (
        not getattr(config, "tie_word_embeddings", False)
        or get_head is None
        or spec.target_modules == "all-linear"
    ):
        return
    head = get_head()
    name = next((n for n, m in model.named_modules() if m is head), None)
    if name and _matches(name, spec.target_modules) and not _matches(name, spec.exclude_modules):
        raise ConfigError(
            f"{_KEY}.target_modules={_shown(spec.target_modules)} adapts {name}, which this model ties to "
            "its input embedding (tie_word_embeddings); the merged head would differ from the embedding, "
            "which the tied rollout and exported models cannot hold",
            where=f"{_KEY}.target_modules",
            fix=f"leave {name} out of target_modules (all-linear leaves it out)",
        )


def add_lora(model: torch.nn.Module, spec: LoraSpec) -> Any:
    """Inject LoRA adapters into `model` in place and freeze everything else; return the `peft.PeftModel`
    around it (its `disable_adapter()` is `adapters_disabled`). The adapters' A is initialised from torch's
    global RNG (seed it first for a reproducible run) and B is zero, so the adapted model starts equal to
    the base one. A listed module name that matches nothing, or an adapter on an LM head tied to the input
    embedding, raises `ConfigError`."""
    from peft import LoraConfig, get_peft_model

    if spec.rank <= 0:
        raise ConfigError(f"{_KEY}.lora_rank={spec.rank} builds no adapter", fix="set lora_rank > 0")
    _check_names(model, spec)
    _check_tied_head(model, spec)
    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    excl = spec.exclude_modules
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=targets,
        exclude_modules=excl if excl is None or isinstance(excl, str) else list(excl),
        lora_dropout=0.0,
        bias="none",
    )
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated property name
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, config)
    except ValueError as e:  # every target excluded, or no module of a supported type
        raise ConfigError(
            f"{_KEY}.target_modules={spec.target_modules!r} with exclude_modules={spec.exclude_modules!r} "
            f"leaves no layer peft can adapt ({e})",
            where=f"{_KEY}.target_modules",
            fix=f"name linear layers of the model ({_short_names(model)})",
        ) from e
    return peft_model


def add_lora_on_meta(model: torch.nn.Module, spec: LoraSpec) -> tuple[Any, dict[str, torch.Tensor]]:
    """`add_lora` on a model whose parameters are on the meta device: the adapters end up on the meta device
    too (to be sharded and allocated with the rest), and their initial values are returned, keyed by the
    adapter's parameter name in `model` (`...q_proj.lora_A.default.weight`), on the CPU in the base layer's
    dtype. peft creates and initialises each adapter on the CPU from torch's global RNG before moving it to
    its base layer's device; the values are taken just before that move, so they are bitwise the ones
    `add_lora` gives a real model from the same RNG state."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    taken: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    move = BaseTunerLayer._move_adapter_to_device_of_base_layer

    def take_then_move(self: Any, adapter_name: str, device: torch.device | None = None) -> None:
        values = taken.setdefault((id(self), adapter_name), {})
        for layer_name in self.adapter_layer_names:
            layer = getattr(self, layer_name, None)
            if isinstance(layer, (torch.nn.ModuleDict, torch.nn.ParameterDict)) and adapter_name in layer:
                item = layer[adapter_name]
                named = item.named_parameters() if isinstance(item, torch.nn.Module) else [("", item)]
                for pname, p in named:
                    key = f"{layer_name}.{adapter_name}" + (f".{pname}" if pname else "")
                    if p.device.type != "meta" and key not in values:
                        values[key] = p.detach().clone()
        move(self, adapter_name, device)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = take_then_move  # type: ignore[method-assign]
    try:
        peft_model = add_lora(model, spec)
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move  # type: ignore[method-assign]
    init: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not _is_lora_layer(module):
            continue
        dtype = module.get_base_layer().weight.dtype
        for adapter in module.lora_A:
            for key, value in taken.get((id(module), adapter), {}).items():
                init[f"{name}.{key}"] = value.to(dtype) if value.is_floating_point() else value
    params = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(init) != params:
        missing = sorted(params - set(init))[:3]
        raise RuntimeError(f"peft created adapter parameters {missing} without initialising them on the CPU")
    return peft_model, init


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def hf_name(name: str) -> str | None:
    """The base model's name of a parameter of the LoRA-injected model (`x.base_layer.weight` -> `x.weight`,
    other names unchanged); None for an adapter parameter (`lora_A`, `lora_B`), which the base model lacks."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def _delta(module: Any, adapter: str, shards: Shards, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows of B·A·scaling of `module`'s `adapter` (rows split as the base weight `like`), in
    float32 at least: the rows of B times the whole A (B and the weight share dim 0), or, for a
    `fan_in_fan_out` layer, the rows of the whole (B·A)ᵀ."""
    a_w = module.lora_A[adapter].weight.detach()
    b_w = module.lora_B[adapter].weight.detach()
    dtype = torch.promote_types(a_w.dtype, torch.float32)
    scaling = float(module.scaling[adapter])
    if getattr(module, "fan_in_fan_out", False):
        whole = (shards.full(b_w).to(dtype) @ shards.full(a_w).to(dtype)) * scaling
        return shards.rows(whole.T, like)
    return (shards.local(b_w).to(dtype) @ shards.full(a_w).to(dtype)) * scaling


def merged_tensors(
    model: torch.nn.Module, dtype: torch.dtype | None = None, shards: Shards = WHOLE
) -> Iterator[tuple[str, torch.Tensor | str]]:
    """The weights of the LoRA-injected HF `model` under the base model's names, as `distinct_tensors`
    yields them (a tied name is given as the earlier name): an adapted linear layer's weight is a new tensor
    `W + B·A·scaling` (summed in float32, rounded to the weight's dtype), every other weight the model's own
    (detached); each cast to `dtype` when given, and no `lora_A` / `lora_B` tensor is listed.

    On a sharded model (`shards`; every rank must iterate, in the same order) each rank merges its own rows
    (its rows of W and B, the whole A) and the merged rows are gathered after the cast, so a gather moves
    `dtype` bytes; the values equal merging the whole model (up to the summation order inside B·A)."""
    owners = {n: m for n, m in model.named_modules() if _is_lora_layer(m)}
    for name, value in distinct_tensors(model.state_dict(keep_vars=True).items()):
        if ".lora_" in name:
            continue
        if isinstance(value, str):
            yield _base_name(name), _base_name(value)
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        module = owners.get(owner) if leaf == "weight" else None
        w = value.detach()
        if module is None:
            if dtype is not None and w.is_floating_point() and w.dtype != dtype:
                w = w.to(dtype)
            yield _base_name(name), shards.full(w)
            continue
        rows = shards.local(w)
        merged = rows.to(torch.promote_types(rows.dtype, torch.float32))
        for a in (a for a in module.active_adapters if a in module.lora_A):
            merged = merged + _delta(module, a, shards, w)
        merged = merged.to(w.dtype)  # rounded once to the weight's dtype, then cast as any weight is
        if dtype is not None:
            merged = merged.to(dtype)
        yield _base_name(name), shards.full_from_local(merged, w)


def merged_state_dict(model: torch.nn.Module, shards: Shards = WHOLE) -> dict[str, torch.Tensor]:
    """`merged_tensors` as a state dict (tied names share the earlier tensor)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in merged_tensors(model, shards=shards):
        out[name] = out[t] if isinstance(t, str) else t
    return out


def adapter_state(peft_model: Any, shards: Shards = WHOLE) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's saved names (`base_model.model.<module>.lora_A.weight`), whole
    (gathered on a sharded model: a collective), detached contiguous copies on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    return {k: shards.full(v.detach()).contiguous().cpu().clone() for k, v in state.items()}


def load_adapter_state(peft_model: Any, folder: str | Path) -> None:
    """Copy the adapter tensors of `folder/adapter_model.safetensors` (a `save_adapter` folder) into
    `peft_model` bitwise; a missing or extra tensor raises KeyError."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; the checkpoint was not written by a LoRA run (actor_rollout_ref.model."
            "lora_rank>0), so set lora_rank as in the run that wrote it."
        )
    loaded = load_file(str(path))
    expected = adapter_state(peft_model)
    if set(loaded) != set(expected):
        diff = sorted(set(loaded) ^ set(expected))[:5]
        raise KeyError(
            f"{path}: adapter tensors {diff} differ from this model's adapters; set lora_rank, "
            "target_modules and exclude_modules as in the run that wrote it."
        )
    params = dict(peft_model.named_parameters())
    adapter = peft_model.active_adapter
    with torch.no_grad():
        for name, t in loaded.items():
            live = name.replace(".lora_A.weight", f".lora_A.{adapter}.weight").replace(
                ".lora_B.weight", f".lora_B.{adapter}.weight"
            )
            if live not in params or params[live].shape != t.shape:
                raise KeyError(f"{path}: {name} does not fit this model's adapters ({live}).")
            params[live].copy_(t)


def save_adapter(
    peft_model: Any, out_dir: str | Path, state: Mapping[str, torch.Tensor] | None = None
) -> Path:
    """The adapter-only export in peft's format: `adapter_config.json` + `adapter_model.safetensors` (loadable
    with `peft.PeftModel.from_pretrained(base, out_dir)`); `state` the adapter tensors when given (a sharded
    model's, gathered by `adapter_state(peft_model, shards)`), else `adapter_state(peft_model)`."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_model.peft_config[peft_model.active_adapter]
    config.save_pretrained(str(out))
    tensors = dict(state) if state is not None else adapter_state(peft_model)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


@contextlib.contextmanager
def adapters_disabled(peft_model: Any) -> Iterator[None]:
    """Run the base model (adapters bypassed, nothing merged or changed) while the context is open."""
    with peft_model.disable_adapter():
        yield
