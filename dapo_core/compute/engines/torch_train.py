"""Single-process PyTorch training engine: AdamW, global-norm clipping, warmup + constant/cosine LR.

Checkpoint layout written by `save(dir)`:
- `model.safetensors` + `config.json` (+ tokenizer): the weights as an HF folder (loadable on its own);
- `optim.{json,tensors}`: `optimizer.state_dict()`; `extra_state.{json,tensors}`: scheduler state, step
  counters, RNG states (safetensors format + JSON, `dapo_core.store.state_files`: nothing read back is
  executed).

With LoRA (`lora=LoraSpec`, `dapo_core.compute.lora`) only the adapters train: the optimizer holds them alone,
a weight push and `model.safetensors` carry the merged weights under the base model's names, the export and
checkpoint add the adapter in peft's format in `lora_adapter/` (`adapter_config.json` +
`adapter_model.safetensors`), and `load` restores the adapter (the frozen base weights are the model
folder's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from dapo_core.compute import lora as lora_lib
from dapo_core.compute.engines.train import (
    TrainEngine,
    adamw_kwargs,
    enable_gradient_checkpointing,
    lr_lambda_for,
)
from dapo_core.compute.models import load_model
from dapo_core.config import OptimConfig
from dapo_core.seeding import get_rng_state, set_rng_state

__all__ = ["TorchTrainEngine", "load_hf_weights_into"]

OPTIM_FILE = "optim.pt"
EXTRA_FILE = "extra_state.pt"


@torch.no_grad()
def load_hf_weights_into(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy the `*.safetensors` weights of `folder` into `model` in place (bitwise; tied weights allowed)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}; is it a checkpoint written by save()?")
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        loaded.update(load_file(str(f)))
    state = model.state_dict()
    unknown = sorted(set(loaded) - set(state))
    if unknown:
        raise KeyError(f"{folder}: tensors {unknown[:5]} are not parameters of the model; wrong checkpoint?")
    for name, t in loaded.items():
        state[name].copy_(t)
    ptrs = {state[n].data_ptr() for n in loaded}
    missing = [n for n in state if n not in loaded and state[n].data_ptr() not in ptrs]
    if missing:
        raise KeyError(f"{folder}: checkpoint lacks {missing[:5]}; it was written for a different model.")


class TorchTrainEngine(TrainEngine):
    """Plain PyTorch engine (one process, CPU or one GPU), optionally in autocast mixed precision."""

    def __init__(
        self,
        model_path: str | Path,
        optim_cfg: OptimConfig | Mapping[str, Any],
        *,
        total_steps: int,
        grad_clip: float | None,
        device: str = "cpu",
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        gradient_checkpointing: bool = False,
        compute_dtype: torch.dtype | None = None,
        lora: lora_lib.LoraSpec | None = None,
    ) -> None:
        """Weights, gradients and optimizer state in `dtype`; forward and backward under `torch.autocast`
        to `compute_dtype` when it differs (bf16 matmuls, float32 master weights). `lora`: train LoRA
        adapters (`lora.add_lora`) on the frozen model instead of every weight."""
        self.autocast_dtype = None if compute_dtype in (None, dtype) else compute_dtype
        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.seed = int(seed)
        self.total_steps = int(total_steps)
        self.grad_clip = None if grad_clip is None or grad_clip <= 0 else float(grad_clip)
        torch.manual_seed(self.seed)
        self.model = load_model(self.model_path, dtype=dtype, device=self.device)
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.lora = lora
        self.peft: Any = None
        """The `peft.PeftModel` around `model` when LoRA is on (the adapters are inside `model`)."""
        if lora is not None:
            self.peft = lora_lib.add_lora(self.model, lora)
        self.model.train()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, **adamw_kwargs(optim_cfg))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda_for(optim_cfg, self.total_steps)
        )
        self.optimizer_steps = 0
        self.skipped_steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` into `.grad`."""
        loss.backward()

    def step(self) -> float:
        """Clip to `grad_clip`, AdamW step (skipped on a non-finite norm), zero grads; return the norm."""
        return self._clipped_step(self.optimizer, self.grad_clip)

    @property
    def lr(self) -> float:
        """Current learning rate."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Detached views of all weights under HF names (tied weights listed under each name); with LoRA the
        merged weights (`lora.merged_state_dict`)."""
        if self.peft is not None:
            return lora_lib.merged_state_dict(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def iter_sync_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | str]]:
        """The weights for a push under HF names; with LoRA the merged ones, one adapted layer at a time."""
        if self.peft is None:
            yield from super().iter_sync_tensors(dtype)
        else:
            yield from lora_lib.merged_tensors(self.model)

    def ref_mode(self) -> contextlib.AbstractContextManager[Any]:
        """The base model (adapters off) while open: the reference policy of a LoRA run."""
        if self.peft is None:
            return super().ref_mode()
        return lora_lib.adapters_disabled(self.peft)

    def export_hf(self, out_dir: str | Path) -> Path:
        """The HF folder (weights + config + tokenizer); with LoRA the merged weights under the base names,
        and the adapter in peft's format in its `lora_adapter/` sub-folder."""
        if self.peft is None:
            return super().export_hf(out_dir)
        from dapo_core.compute.models import load_tokenizer, save_model

        try:
            tokenizer = load_tokenizer(self.model_path)
        except FileNotFoundError:
            tokenizer = None
        out = save_model(self.model, tokenizer, out_dir, state_dict=lora_lib.merged_state_dict(self.model))
        lora_lib.save_adapter(self.peft, out / lora_lib.ADAPTER_SUBDIR)
        return out

    def save(self, out_dir: str | Path) -> Path:
        """Write weights (HF safetensors + tokenizer; with LoRA the adapter folder instead,
        `dapo_core.compute.lora_checkpoint`), optimizer, scheduler and RNG states to `out_dir`.

        Optimizer and extra state go to `optim.{json,tensors}` and `extra_state.{json,tensors}`
        (`dapo_core.store.state_files`: tensors + JSON, never pickle)."""
        from dapo_core.compute.lora_checkpoint import write_adapter_folder
        from dapo_core.store.state_files import save_state

        if self.peft is None:
            out = self.export_hf(out_dir)
        else:
            out = write_adapter_folder(self.peft, out_dir, self.model_path)
        save_state(out, "optim", self.optimizer.state_dict())
        save_state(
            out,
            "extra_state",
            {
                "scheduler": self.scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
                "rng": get_rng_state(),
                "engine": "torch",
                "lora_rank": 0 if self.lora is None else self.lora.rank,
            },
        )
        return out

    def load(self, ckpt_dir: str | Path) -> None:
        """Restore weights, optimizer, scheduler, counters and RNG states written by `save` (nothing read is
        executed; a checkpoint of the older pickled layout is refused)."""
        from dapo_core.store.state_files import load_state, refuse_pickled_state

        d = Path(ckpt_dir)
        refuse_pickled_state(d, (OPTIM_FILE, EXTRA_FILE))
        extra = load_state(d, "extra_state")
        if extra.get("engine") != "torch":
            raise ValueError(
                f"{d} was written by the {extra.get('engine')!r} engine; set "
                "actor_rollout_ref.actor.strategy to match, or start from its exported HF weights."
            )
        rank = 0 if self.lora is None else self.lora.rank
        if int(extra.get("lora_rank", 0)) != rank:
            raise ValueError(
                f"{d} was written with actor_rollout_ref.model.lora_rank={extra.get('lora_rank', 0)} and "
                f"this run has lora_rank={rank}; set lora_rank as in the run that wrote it (a LoRA "
                "checkpoint holds only the adapter), or start a new run from its exported HF weights "
                "(model.safetensors)."
            )
        if self.peft is not None:
            lora_lib.load_adapter_state(self.peft, d / lora_lib.ADAPTER_SUBDIR)
        else:
            load_hf_weights_into(self.model, d)
        self.optimizer.load_state_dict(load_state(d, "optim"))
        self.scheduler.load_state_dict(extra["scheduler"])
        self.optimizer_steps = int(extra["optimizer_steps"])
        self.skipped_steps = int(extra["skipped_steps"])
        set_rng_state(extra["rng"])
