"""LoRA adapters on a training engine's HF model, built with `peft` (verl's `actor_rollout_ref.model.lora_*`).

`add_lora` injects the adapters into the model in place (its modules gain `base_layer` / `lora_A` / `lora_B`
children) and freezes every other weight, so only the adapters get gradients and optimizer state. The rest
works on that model:
- `merged_tensors`: the weights under the base model's own names, each adapted linear weight merged as
  `W + B·A·lora_alpha/lora_rank` into a new tensor (the base weight is never modified), for a weight push and
  the HF export;
- `adapter_state` / `load_adapter_state`: the adapter tensors alone (a checkpoint's
  `adapter_model.safetensors`); `save_adapter`: the adapter-only export in peft's format
  (`adapter_config.json` + `adapter_model.safetensors`);
- `adapters_disabled`: the base model's forward (the reference policy) while the context is open.
"""

from __future__ import annotations

import contextlib
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
    "LoraSpec",
    "adapter_state",
    "adapters_disabled",
    "add_lora",
    "check_strategy",
    "load_adapter_state",
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


def check_strategy(strategy: str, spec: LoraSpec, builds_adapters: bool) -> None:
    """Refuse LoRA on a training engine that does not build adapters (`builds_adapters` false), in one
    paragraph naming the strategy that does."""
    if not builds_adapters:
        raise ConfigError(
            f"{_KEY}.lora_rank={spec.rank} asks for LoRA adapters, which only the torch training engine "
            f"builds so far, and actor_rollout_ref.actor.strategy={strategy!r}",
            where="actor_rollout_ref.actor.strategy",
            fix="set actor_rollout_ref.actor.strategy=torch (one process, CPU or one GPU) for LoRA, or "
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


def add_lora(model: torch.nn.Module, spec: LoraSpec) -> Any:
    """Inject LoRA adapters into `model` in place and freeze everything else; return the `peft.PeftModel`
    around it (its `disable_adapter()` is `adapters_disabled`). The adapters' A is initialised from torch's
    global RNG (seed it first for a reproducible run) and B is zero, so the adapted model starts equal to
    the base one. A listed module name that matches nothing raises `ConfigError`."""
    from peft import LoraConfig, get_peft_model

    if spec.rank <= 0:
        raise ConfigError(f"{_KEY}.lora_rank={spec.rank} builds no adapter", fix="set lora_rank > 0")
    _check_names(model, spec)
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


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _base_name(name: str) -> str:
    """The base model's name of a parameter inside an adapted module (`x.base_layer.weight` -> `x.weight`)."""
    return name.replace(".base_layer.", ".")


def _delta(module: Any, adapter: str) -> torch.Tensor:
    """B·A·scaling of `module`'s `adapter`, in float32 at least (the merge rounds once, to the weight's
    dtype)."""
    a = module.lora_A[adapter].weight
    b = module.lora_B[adapter].weight
    dtype = torch.promote_types(a.dtype, torch.float32)
    delta = (b.detach().to(dtype) @ a.detach().to(dtype)) * float(module.scaling[adapter])
    return delta.T if getattr(module, "fan_in_fan_out", False) else delta


def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | str]]:
    """The weights of the LoRA-injected HF `model` under the base model's names, as `distinct_tensors`
    yields them (a tied name is given as the earlier name): an adapted linear layer's weight is a new tensor
    `W + B·A·scaling` (in the weight's dtype, summed in float32), every other weight the model's own
    (detached); no `lora_A` / `lora_B` tensor is listed."""
    owners = {n: m for n, m in model.named_modules() if _is_lora_layer(m)}
    for name, value in distinct_tensors(model.state_dict(keep_vars=True).items()):
        if ".lora_" in name:
            continue
        if isinstance(value, str):
            yield _base_name(name), _base_name(value)
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        module = owners.get(owner) if leaf == "weight" else None
        if module is None:
            yield _base_name(name), value.detach()
            continue
        active = [a for a in module.active_adapters if a in module.lora_A]
        w = value.detach()
        merged = w.to(torch.promote_types(w.dtype, torch.float32))
        for a in active:
            merged = merged + _delta(module, a)
        yield _base_name(name), merged.to(w.dtype)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`merged_tensors` as a state dict (tied names share the earlier tensor)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in merged_tensors(model):
        out[name] = out[t] if isinstance(t, str) else t
    return out


def adapter_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's saved names (`base_model.model.<module>.lora_A.weight`), detached
    contiguous copies on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    return {k: v.detach().contiguous().cpu().clone() for k, v in state.items()}


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


def save_adapter(peft_model: Any, out_dir: str | Path) -> Path:
    """The adapter-only export in peft's format: `adapter_config.json` + `adapter_model.safetensors` (loadable
    with `peft.PeftModel.from_pretrained(base, out_dir)`)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = peft_model.peft_config[peft_model.active_adapter]
    config.save_pretrained(str(out))
    save_file(adapter_state(peft_model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


@contextlib.contextmanager
def adapters_disabled(peft_model: Any) -> Iterator[None]:
    """Run the base model (adapters bypassed, nothing merged or changed) while the context is open."""
    with peft_model.disable_adapter():
        yield
