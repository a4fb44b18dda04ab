"""DeepSpeed training engine (ZeRO 1/2/3), single process; the gloo backend works on CPU.

The optimizer is our AdamW handed to `deepspeed.initialize` (ZeRO wraps it); the LR scheduler is a
`LambdaLR` on that AdamW that we step ourselves once per TRAIN step (DeepSpeed would step it per optimizer
step). Gradient accumulation is ours (`gradient_accumulation_steps` is 1; `ppo_update` decides when to call
`step()`); DeepSpeed clips (`gradient_clipping`) and skips a step whose gradient is not finite. For one
process it needs the torch.distributed env vars (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), set here only when absent, with a free port. The first initialize on a machine
JIT-compiles `deepspeed_shm_comm` (cached afterwards).

`save(dir)` writes the torch engine's files (the full weights as an HF folder, gathered under ZeRO-3, and
`extra_state.{json,tensors}`: scheduler, counters, RNG states; no pickle) except that the optimizer state is
DeepSpeed's own, in `deepspeed/` (model + optimizer state, restored bitwise by `load`), not `optim.*`.

LoRA (`lora=LoraSpec`, `dapo_core.compute.lora`): the peft adapters are injected into the model (from the
seeded RNG, as the torch engine does) before `deepspeed.initialize`, and only the adapters reach our AdamW, so
ZeRO's fp32 master copies, gradient partitions and AdamW moments cover the adapters alone; the frozen base
weights are the module's (in bf16 with `deepspeed.bf16`; partitioned with the rest under ZeRO-3). `ref_mode`
disables the adapters (the reference policy). A weight push, `state_dict_for_sync` and the HF export give the
merged weights `W + B·A·alpha/r` under the base names (`lora.merged_tensors`, inside the ZeRO-3 gather); the
export adds the adapter-only peft folder `lora_adapter/`. A checkpoint's `deepspeed/` holds the adapters and
their optimizer state only (`save_checkpoint(exclude_frozen_parameters=True)`; the base is the model
folder's).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
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
from dapo_core.config import DeepSpeedConfig, OptimConfig, section
from dapo_core.seeding import get_rng_state, set_rng_state

__all__ = ["DeepSpeedTrainEngine", "build_deepspeed_config", "ensure_single_process_env"]

EXTRA_FILE = "extra_state.pt"
DS_SUBDIR = "deepspeed"
DS_TAG = "state"
_DS_KEYS = ("zero_stage", "offload_optimizer", "offload_param", "bf16", "config")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_single_process_env() -> None:
    """Set RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT for one process if unset."""
    defaults = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())


def build_deepspeed_config(
    deepspeed_cfg: Mapping[str, Any] | None, grad_clip: float | None
) -> dict[str, Any]:
    """DeepSpeed JSON config from our `actor_rollout_ref.actor.deepspeed` block.

    Keys (`DeepSpeedConfig`, whose defaults fill what is left out): `zero_stage` (0-3),
    `offload_optimizer` (bool; CPU AdamW offload — JIT-compiles cpu_adam), `offload_param` (bool;
    parameters on the CPU, ZeRO-3 only), `bf16` (bool), `config` (a raw DeepSpeed dict merged last, for
    anything else).
    """
    cfg = dict(deepspeed_cfg or {})
    unknown = sorted(set(cfg) - set(_DS_KEYS))
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.actor.deepspeed has unknown keys {unknown}; accepted: {list(_DS_KEYS)} "
            "(put raw DeepSpeed settings under deepspeed.config)."
        )
    typed_cfg = section(DeepSpeedConfig, {k: v for k, v in cfg.items() if k != "config"})
    stage = int(typed_cfg.zero_stage)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"actor_rollout_ref.actor.deepspeed.zero_stage={stage} must be 0, 1, 2 or 3.")
    zero: dict[str, Any] = {"stage": stage}
    if typed_cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if typed_cfg.offload_param:
        if stage != 3:
            raise ValueError(
                f"actor_rollout_ref.actor.deepspeed.offload_param needs zero_stage=3 (got {stage})."
            )
        zero["offload_param"] = {"device": "cpu"}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(grad_clip) if grad_clip and grad_clip > 0 else 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if typed_cfg.bf16:
        ds["bf16"] = {"enabled": True}
    for key, value in dict(cfg.get("config") or {}).items():
        if isinstance(value, Mapping) and isinstance(ds.get(key), dict):
            ds[key] = {**ds[key], **dict(value)}
        else:
            ds[key] = value
    return ds


def _skip_shm_comm_op(deepspeed: Any) -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory all-reduce op (`deepspeed_shm_comm`).

    On the CPU accelerator DeepSpeed compiles that C++ op with ninja the first time its communication backend
    starts, and again whenever the environment's path changes (a fresh clone). The op only speeds
    all-reduces between ranks of one node, and this engine runs one process, so the op would never carry
    data: marking it incompatible makes DeepSpeed use plain torch.distributed, as it does wherever the op is
    missing."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedTrainEngine(TrainEngine):
    """DeepSpeed ZeRO engine with the same primitives as `TorchTrainEngine`."""

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
        deepspeed_cfg: Mapping[str, Any] | None = None,
        lora: lora_lib.LoraSpec | None = None,
    ) -> None:
        """`lora`: train LoRA adapters (`lora.add_lora`) on the frozen model instead of every weight."""
        import deepspeed

        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.seed = int(seed)
        self.total_steps = int(total_steps)
        self.grad_clip = None if grad_clip is None or grad_clip <= 0 else float(grad_clip)
        self.ds_config = build_deepspeed_config(deepspeed_cfg, self.grad_clip)
        self.zero_stage = int(self.ds_config["zero_optimization"]["stage"])
        ensure_single_process_env()
        if self.device.type == "cpu":
            _skip_shm_comm_op(deepspeed)
        if not torch.distributed.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            deepspeed.init_distributed(dist_backend=backend)
        torch.manual_seed(self.seed)
        # ZeRO-3 partitions (and with offload_param keeps on the CPU) what it is given: load on the CPU so the
        # full float32 model never sits on the GPU; DeepSpeed casts to bf16 and moves it before partitioning.
        load_device = torch.device("cpu") if self.zero_stage == 3 else self.device
        model = load_model(self.model_path, dtype=dtype, device=load_device)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.lora = lora
        self.peft: Any = None
        """The `peft.PeftModel` around `model` when LoRA is on (the adapters are inside `model`)."""
        if lora is not None:
            self.peft = lora_lib.add_lora(model, lora)
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        base_opt = torch.optim.AdamW(trainable, **adamw_kwargs(optim_cfg))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            base_opt, lr_lambda_for(optim_cfg, self.total_steps)
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=base_opt, config=self.ds_config
        )
        self.base_optimizer = base_opt
        self.model = self.engine.module
        if lora is not None:
            self._keep_frozen_out_of_checkpoints()
        self.optimizer_steps = 0
        self.skipped_steps = 0

    def _keep_frozen_out_of_checkpoints(self) -> None:
        """Make the DeepSpeed engine's module state (what `save_checkpoint` writes) leave out every frozen
        weight under each of its names: `exclude_frozen_parameters` drops a tied weight under one name only
        (a tied LM head, the size of the embedding, would stay)."""
        from deepspeed import DeepSpeedEngine

        engine = self.engine
        frozen = {n for n, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}

        def module_state_dict(
            destination: Any = None, prefix: str = "", keep_vars: bool = False, **kwargs: Any
        ) -> dict[str, torch.Tensor]:
            sd = DeepSpeedEngine.module_state_dict(engine, destination, prefix, keep_vars, **kwargs)
            for name in frozen:
                sd.pop(prefix + name, None)
            return sd

        engine.module_state_dict = module_state_dict

    def _module(self) -> torch.nn.Module:
        return self.engine

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (no scaling by accumulation steps; reduction is deferred to
        `step`)."""
        self.engine.set_gradient_accumulation_boundary(False)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """DeepSpeed step (clip + AdamW; skipped when the grad norm is not finite); return the norm."""
        # Every backward ran as a non-boundary micro step; close the accumulation window here.
        self.engine.set_gradient_accumulation_boundary(True)
        if self.zero_stage == 2:
            # ZeRO-2 moves gradients into its partitions from backward hooks, and only a boundary
            # backward fills the buffers `step` reads: run one whose gradients are exactly zero.
            zero = sum((p * 0.0).sum() for p in self.model.parameters() if p.requires_grad)
            self.engine.backward(zero, scale_wrt_gas=False)
        else:
            self.engine.allreduce_gradients()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        applied = self.engine.was_step_applied() and math.isfinite(norm)
        if applied:
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
            if math.isfinite(norm):
                norm = float("inf")
        return norm

    @property
    def lr(self) -> float:
        """Current learning rate."""
        return float(self.base_optimizer.param_groups[0]["lr"])

    @contextlib.contextmanager
    def _full_params(self) -> Iterator[None]:
        """Materialise full parameters (ZeRO-3 gathers them; no-op for other stages)."""
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                yield
        else:
            yield

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full weights under HF names (copies under ZeRO-3, detached views otherwise); with LoRA the merged
        weights (`lora.merged_state_dict`)."""
        with self._full_params():
            if self.peft is not None:
                sd = lora_lib.merged_state_dict(self.model)
            else:
                sd = {k: v.detach() for k, v in self.model.state_dict().items()}
            if self.zero_stage == 3:
                return {k: v.clone() for k, v in sd.items()}
            return sd

    def iter_sync_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | str]]:
        """The weights one at a time, inside the gather of the full parameters (ZeRO-3 gathers them all at
        once: a per-layer gather is not implemented); with LoRA the merged ones, one adapted layer at a
        time."""
        with self._full_params():
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
        """Write the full (gathered) weights as an HF folder with the tokenizer; with LoRA the merged weights
        under the base names, and the adapter in peft's format in its `lora_adapter/` sub-folder."""
        with self._full_params():
            if self.peft is None:
                return super().export_hf(out_dir)
            from dapo_core.compute.models import load_tokenizer, save_model

            try:
                tokenizer = load_tokenizer(self.model_path)
            except FileNotFoundError:
                tokenizer = None
            merged = lora_lib.merged_state_dict(self.model)
            out = save_model(self.model, tokenizer, out_dir, state_dict=merged)
            lora_lib.save_adapter(self.peft, out / lora_lib.ADAPTER_SUBDIR)
            return out

    @property
    def _lora_rank(self) -> int:
        return 0 if self.lora is None else self.lora.rank

    def save(self, out_dir: str | Path) -> Path:
        """Write HF weights, DeepSpeed model + optimizer state, scheduler and RNG states to `out_dir`; with
        LoRA DeepSpeed's state covers the adapters alone, and the adapter folder
        (`dapo_core.compute.lora_checkpoint`) stands in for the HF weights."""
        from dapo_core.compute.lora_checkpoint import write_adapter_folder
        from dapo_core.store.state_files import save_state

        if self.peft is None:
            out = self.export_hf(out_dir)
        else:
            with self._full_params():
                out = write_adapter_folder(self.peft, out_dir, self.model_path)
        rng = get_rng_state()  # DeepSpeed must not perturb what we save
        self.engine.save_checkpoint(
            str(out / DS_SUBDIR),
            tag=DS_TAG,
            save_latest=False,
            exclude_frozen_parameters=self.peft is not None,
        )
        save_state(
            out,
            "extra_state",
            {
                "scheduler": self.scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
                "rng": rng,
                "engine": "deepspeed",
                "zero_stage": self.zero_stage,
                "lora_rank": self._lora_rank,
            },
        )
        return out

    def load(self, ckpt_dir: str | Path) -> None:
        """Restore a checkpoint written by `save` with the same ZeRO stage (bitwise). Our extra state is read
        without pickle; DeepSpeed unpickles its own `deepspeed/*.pt` in full, so each is first checked with
        torch's restricted unpickler, allowing only the DeepSpeed classes its optimizer state holds."""
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        from dapo_core.store.state_files import (
            load_state,
            refuse_pickled_state,
            refuse_unsafe_pickles,
            state_files,
        )

        d = Path(ckpt_dir)
        refuse_pickled_state(d, (EXTRA_FILE,))
        refuse_unsafe_pickles(d / DS_SUBDIR, (fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler))
        if not state_files(d, "extra_state")[0].is_file() or not (d / DS_SUBDIR / DS_TAG).is_dir():
            raise FileNotFoundError(
                f"{d} lacks extra_state.json or {DS_SUBDIR}/{DS_TAG}; it is not a complete DeepSpeed-engine "
                "checkpoint."
            )
        extra = load_state(d, "extra_state")
        if extra.get("engine") != "deepspeed" or int(extra.get("zero_stage", -1)) != self.zero_stage:
            raise ValueError(
                f"{d} was written by engine={extra.get('engine')!r} zero_stage={extra.get('zero_stage')}; "
                f"this engine is deepspeed zero_stage={self.zero_stage}. Set "
                "actor_rollout_ref.actor.deepspeed.zero_stage to match."
            )
        if int(extra.get("lora_rank", 0)) != self._lora_rank:
            raise ValueError(
                f"{d} was written with actor_rollout_ref.model.lora_rank={extra.get('lora_rank', 0)} and "
                f"this run has lora_rank={self._lora_rank}; set lora_rank as in the run that wrote it (a "
                "LoRA checkpoint holds only the adapter), or start a new run from its exported HF weights "
                "(model.safetensors)."
            )
        path, _ = self.engine.load_checkpoint(
            str(d / DS_SUBDIR),
            tag=DS_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=self.peft is None,  # a LoRA checkpoint lacks the frozen base weights
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load {d / DS_SUBDIR}; see the log above.")
        self.scheduler.load_state_dict(extra["scheduler"])
        self.optimizer_steps = int(extra["optimizer_steps"])
        self.skipped_steps = int(extra["skipped_steps"])
        set_rng_state(extra["rng"])

    def close(self) -> None:
        """Release the DeepSpeed engine (the process group stays for later engines). Safe to call twice."""
        engine = getattr(self, "engine", None)
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()
        self.engine = None
