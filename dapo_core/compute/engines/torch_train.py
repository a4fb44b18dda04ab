"""Single-process PyTorch training engine: AdamW, global-norm clipping, warmup + constant/cosine LR.

Checkpoint layout written by `save(dir)`:
- `model.safetensors` + `config.json` (+ tokenizer): the weights as an HF folder (loadable on its own);
- `optim.{json,tensors}`: `optimizer.state_dict()`; `extra_state.{json,tensors}`: scheduler state, step
  counters, RNG states (safetensors format + JSON, `dapo_core.store.state_files`: nothing read back is
  executed).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

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
    ) -> None:
        """Weights, gradients and optimizer state in `dtype`; forward and backward under `torch.autocast`
        to `compute_dtype` when it differs (bf16 matmuls, float32 master weights)."""
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
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **adamw_kwargs(optim_cfg))
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
        """Detached views of all weights under HF names (tied weights listed under each name)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save(self, out_dir: str | Path) -> Path:
        """Write weights (HF safetensors + tokenizer), optimizer, scheduler and RNG states to `out_dir`.

        Optimizer and extra state go to `optim.{json,tensors}` and `extra_state.{json,tensors}`
        (`dapo_core.store.state_files`: tensors + JSON, never pickle)."""
        from dapo_core.store.state_files import save_state

        out = self.export_hf(out_dir)
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
        load_hf_weights_into(self.model, d)
        self.optimizer.load_state_dict(load_state(d, "optim"))
        self.scheduler.load_state_dict(extra["scheduler"])
        self.optimizer_steps = int(extra["optimizer_steps"])
        self.skipped_steps = int(extra["skipped_steps"])
        set_rng_state(extra["rng"])
