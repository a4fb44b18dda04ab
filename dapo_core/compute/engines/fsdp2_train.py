"""FSDP2 training engine (`actor.strategy: fsdp2`): the model, its gradients and AdamW state sharded over the
role's data-parallel ranks with `torch.distributed.fsdp.fully_shard` (each decoder layer, then the root).

Loading: the model is built with its parameters on the meta device (buffers such as rotary frequencies are
computed for real), sharded, then each rank reads only its rows of every tensor from the safetensors files
(`safe_open(...).get_slice`): no process holds the full model. Gradients are averaged over the ranks by FSDP;
the loss is multiplied by `dp_size` (`global_batch_info`), so the update equals one process's over the whole
mini-batch. Each forward is one module call (the shared-prompt forward, which makes two, is not used).

Checkpoint written by `save(dir)`: per rank `model.rank<r>.safetensors` (its parameter shards),
`optim.rank<r>.{json,tensors}` and `extra_state.rank<r>.{json,tensors}` (scheduler, counters, RNG), plus
`fsdp2.json` (world size, each parameter's global shape and each rank's rows) and a full HF export written
by rank 0 (`model.safetensors`, config, tokenizer) for evaluation; with LoRA the shards are the adapters'
and rank 0 writes the adapter folder instead of the export (`lora_checkpoint`). Resuming needs the same world
size.
docs/ARCHITECTURE.md (Engines) says why FSDP2 rather than ZeRO-3.

LoRA (`lora=LoraSpec`, `dapo_core.compute.lora`): the peft adapters are injected into the meta model before
sharding, so each adapted decoder layer's FSDP unit holds its frozen base weights and its `lora_A` / `lora_B`
together, and FSDP2 shards the adapters with their layer (dim 0, like every parameter) rather than
replicating them: FSDP2 keeps one sharded parameter per original, each with its own `requires_grad`, gathers a
unit's frozen and trainable parameters in one all-gather and reduce-scatters only the gradients that exist.
Sharding keeps the adapters' gradients and AdamW state at 1/dp per rank (a 32B model's all-linear adapters at
rank 64 are 0.54 B parameters: 8.6 GB of float32 weights, gradients and AdamW moments if replicated) and
needs no gradient all-reduce of our own. Every rank initialises the whole adapters on the CPU from the seeded
RNG exactly as the torch engine does (`lora.add_lora_on_meta`) and keeps its rows, so dp ranks equal one
torch-engine process. Only the adapters reach the optimizer. The base rows are read under the HF names
(`q_proj.base_layer.weight` from `q_proj.weight`). `ref_mode` disables the adapters (the reference policy).
A weight push and the HF export send `W + B·A·alpha/r` under the base names (`lora.merged_tensors`): each
rank merges its own rows (its rows of W and B, the whole A, in float32) and the merged rows are gathered in
the push dtype, so a push moves the bytes it moves without LoRA. The export adds the adapter-only peft folder
`lora_adapter/`; a checkpoint's `model.rank<r>.safetensors` and `optim.rank<r>` hold the adapter shards and
their AdamW state alone (the base is the model folder's).
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dapo_core.compute import dist as dpd
from dapo_core.compute import lora as lora_lib
from dapo_core.compute.engines.train import (
    TrainEngine,
    adamw_kwargs,
    enable_gradient_checkpointing,
    lr_lambda_for,
)
from dapo_core.compute.models import copy_model_files
from dapo_core.compute.safetensors_stream import StreamedSafetensors
from dapo_core.compute.weight_transport import distinct_tensors
from dapo_core.config import OptimConfig
from dapo_core.errors import DapoUserError
from dapo_core.seeding import get_rng_state, set_rng_state

__all__ = [
    "SHARDS",
    "DTensorShards",
    "FSDP2TrainEngine",
    "ShardedCheckpointMismatch",
    "load_hf_shards",
    "load_rows",
    "materialize",
    "parameters_on_meta",
]

MANIFEST = "fsdp2.json"

# FSDP2 calls torch.distributed's own deprecated reduce-scatter on gloo; not ours to act on, and a worker's
# warning line would reach every console.
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)


class ShardedCheckpointMismatch(DapoUserError):
    """A sharded checkpoint does not fit this engine: written by another number of data-parallel ranks, with
    another `lora_rank`, or for other parameters."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside create their parameters on the meta device; buffers stay real (CPU)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters[name]
        if p is not None and p.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _rows(n: int, rank: int, size: int) -> tuple[int, int]:
    """FSDP2's dim-0 shard of `n` rows on `rank`: torch.chunk's split, [start, stop)."""
    chunk = math.ceil(n / size) if n else 0
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


def _tensor_files(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                where[k] = f
    if not where:
        raise FileNotFoundError(
            f"no *.safetensors in {folder}; set actor_rollout_ref.model.path to an HF folder"
        )
    return where


def materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Allocate the parameters of a model built on the meta device (`parameters_on_meta`, then sharded) on
    `device`, keeping its real buffers; the parameters hold no values until loaded."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


@torch.no_grad()
def load_hf_shards(model: torch.nn.Module, folder: Path, rank: int, size: int, prefix: str = "") -> None:
    """Copy rank `rank`'s rows (FSDP2's dim-0 shard of `size`) of every parameter of `model` from the HF
    safetensors of `folder`, where parameter `name` is stored as `prefix + name`; only those rows are read.
    In a LoRA-injected model the base weights are read under their HF names (`lora.hf_name`) and the
    adapters, which the folder lacks, are left for `load_rows`."""
    from safetensors import safe_open

    where = _tensor_files(folder)
    handles: dict[Path, Any] = {}
    try:
        for name, p in model.named_parameters():
            hf = lora_lib.hf_name(name)
            if hf is None:
                continue
            key = prefix + hf
            if key not in where:
                raise KeyError(f"{folder}: no tensor {key!r}; it was written for a different model")
            h = handles.get(where[key]) or handles.setdefault(
                where[key], safe_open(str(where[key]), framework="pt").__enter__()
            )
            start, stop = _rows(p.shape[0], rank, size)
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(h.get_slice(key)[start:stop])
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


@torch.no_grad()
def load_rows(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], rank: int, size: int) -> None:
    """Copy rank `rank`'s rows of each whole tensor of `tensors` into the sharded parameter of that name."""
    params = dict(model.named_parameters())
    for name, t in tensors.items():
        start, stop = _rows(t.shape[0], rank, size)
        p = params[name]
        (p.to_local() if isinstance(p, DTensor) else p).copy_(t[start:stop])


class DTensorShards(lora_lib.Shards):
    """`lora.Shards` of a model sharded by FSDP2: its parameters are DTensors (dim 0 over the mesh); a plain
    tensor is treated as unsharded."""

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    def full_from_local(self, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if not isinstance(like, DTensor):
            return rows
        return DTensor.from_local(
            rows, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
        ).full_tensor()

    def rows(self, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if not isinstance(like, DTensor):
            return whole
        rank, size = like.device_mesh.get_local_rank(), like.device_mesh.size()
        start, stop = _rows(whole.shape[0], rank, size)
        return whole[start:stop]


SHARDS = DTensorShards()


class FSDP2TrainEngine(TrainEngine):
    """The HF model sharded with FSDP2 over the process group (`dapo_core.compute.dist`); a single process
    makes a group of one."""

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
        reduce_dtype: torch.dtype | None = None,
        lora: lora_lib.LoraSpec | None = None,
    ) -> None:
        """Shards in `dtype`; with `compute_dtype` set, FSDP2 gathers the shards in `compute_dtype` for
        forward and backward and reduce-scatters the gradients in `reduce_dtype`, which defaults to `dtype`
        (float32) whatever the compute dtype (`MixedPrecisionPolicy`; the optimizer steps the `dtype`
        shards). `lora`: train LoRA adapters, sharded with their layers, on the frozen model."""
        from transformers import AutoConfig, AutoModelForCausalLM

        self.dp = dpd.current() or _single_process_group(device)
        self.model_path = Path(model_path)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        )
        self.seed = int(seed)
        self.total_steps = int(total_steps)
        self.grad_clip = None if grad_clip is None or grad_clip <= 0 else float(grad_clip)
        torch.manual_seed(self.seed)
        config = AutoConfig.from_pretrained(str(self.model_path))
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.lora = lora
        self.peft: Any = None
        """The `peft.PeftModel` around `model` when LoRA is on (the adapters are inside `model`)."""
        adapter_init: dict[str, torch.Tensor] = {}
        if lora is not None:
            self.peft, adapter_init = lora_lib.add_lora_on_meta(model, lora)
        mesh = init_device_mesh(self.device.type, (self.dp.size,))
        compute = None if compute_dtype in (None, dtype) else compute_dtype
        reduce = reduce_dtype or dtype
        # FSDP2 reduces in the compute dtype when reduce_dtype is None: name the reduce dtype whenever the
        # compute dtype differs from the shards'; the default policy (no casts) only when neither does.
        policy = MixedPrecisionPolicy(
            param_dtype=compute, reduce_dtype=None if compute is None and reduce == dtype else reduce
        )
        self.mp_policy = policy
        """The FSDP2 mixed-precision policy every unit was sharded with."""
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        materialize(model, self.device)
        self.model = model
        load_hf_shards(model, self.model_path, self.dp.rank, self.dp.size)
        load_rows(model, adapter_init, self.dp.rank, self.dp.size)
        self.model.train()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, **adamw_kwargs(optim_cfg))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda_for(optim_cfg, self.total_steps)
        )
        self.optimizer_steps = 0
        self.skipped_steps = 0

    @staticmethod
    def _local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p

    # -- training ----------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`TrainEngine.forward` with one module call per micro-batch (no shared-prompt forward), so every
        rank issues the same collectives."""
        kwargs["share_prompt"] = False
        return super().forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (reduce-scattered and averaged over the ranks by FSDP)."""
        loss.backward()

    def step(self) -> float:
        """Clip to `grad_clip` by the global norm, AdamW step (skipped on a non-finite norm, the same on
        every rank), zero grads; return the norm."""
        return self._clipped_step(self.optimizer, self.grad_clip)

    @property
    def lr(self) -> float:
        """Current learning rate."""
        return float(self.optimizer.param_groups[0]["lr"])

    # -- weights -----------------------------------------------------------------------------------------
    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full weights under HF names on rank 0 (gathered one tensor at a time); {} on the other ranks.
        With LoRA the merged weights (tied names share a tensor). A collective: every rank must call it."""
        out: dict[str, torch.Tensor] = {}
        if self.peft is not None:
            for k, t in lora_lib.merged_tensors(self.model, shards=SHARDS):
                if self.dp.rank == 0:
                    out[k] = out[t] if isinstance(t, str) else t.to("cpu")
            return out
        for k, v in self.model.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            if self.dp.rank == 0:
                out[k] = full.detach().to("cpu")
        return out

    def iter_sync_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | str]]:
        """Each weight gathered from its shards one at a time (a collective: every rank iterates), in `dtype`
        when given (the shards are cast before the all-gather, so it moves `dtype` bytes); tied names as
        the earlier name. With LoRA the merged weights under the base names: each rank merges its rows of an
        adapted weight in float32 (`lora.merged_tensors`), casts them and the gather moves `dtype` bytes."""
        if self.peft is not None:
            yield from lora_lib.merged_tensors(self.model, dtype, SHARDS)
            return
        for name, v in distinct_tensors(self.model.state_dict(keep_vars=True).items()):
            if isinstance(v, str):
                yield name, v
                continue
            t = v.detach()
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            yield name, t.full_tensor() if isinstance(t, DTensor) else t

    def ref_mode(self) -> contextlib.AbstractContextManager[Any]:
        """The base model (adapters off) while open: the reference policy of a LoRA run."""
        if self.peft is None:
            return super().ref_mode()
        return lora_lib.adapters_disabled(self.peft)

    def export_hf(self, out_dir: str | Path) -> Path:
        """Rank 0 writes the weights as an HF folder (config and tokenizer copied from the model path),
        streaming them into `model.safetensors` one gathered tensor at a time: no rank holds the whole model.
        With LoRA the merged weights under the base names, and the adapter in peft's format in
        `lora_adapter/`. A collective."""
        out = Path(out_dir)
        state = self.model.state_dict(keep_vars=True)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        entries = []
        for name, v in distinct_tensors(state.items()):
            hf = lora_lib.hf_name(name)
            if hf is not None and not isinstance(v, str) and not (tied and hf == "lm_head.weight"):
                entries.append((hf, v.dtype, tuple(v.shape)))
        writer = StreamedSafetensors(out / "model.safetensors", entries) if self.dp.rank == 0 else None
        try:
            for name, t in self.iter_sync_tensors():
                if writer is not None and not isinstance(t, str) and name in writer.names:
                    writer.write(name, t)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is not None:
            writer.close()
        if self.peft is not None:
            adapter = lora_lib.adapter_state(self.peft, SHARDS)
            if self.dp.rank == 0:
                lora_lib.save_adapter(self.peft, out / lora_lib.ADAPTER_SUBDIR, adapter)
        if self.dp.rank == 0:
            self.model.config.save_pretrained(str(out))
            copy_model_files(self.model_path, out)
        if dist.is_initialized():
            dist.barrier(group=self.dp.cpu_group)
        return out

    # -- checkpoints -------------------------------------------------------------------------------------
    def _checkpointed(self) -> dict[str, torch.nn.Parameter]:
        """The parameters a checkpoint holds: every one, or with LoRA the adapters alone."""
        params = dict(self.model.named_parameters())
        return params if self.peft is None else {n: p for n, p in params.items() if p.requires_grad}

    @property
    def _lora_rank(self) -> int:
        return 0 if self.lora is None else self.lora.rank

    def save(self, out_dir: str | Path) -> Path:
        """Every rank writes its shards (with LoRA: of the adapters) and states; rank 0 the manifest and the
        full HF export (with LoRA the adapter folder instead, `dapo_core.compute.lora_checkpoint`)."""
        from safetensors.torch import save_file

        from dapo_core.compute.lora_checkpoint import write_adapter_folder
        from dapo_core.store.state_files import save_state

        if self.peft is None:
            out = self.export_hf(out_dir)
        else:
            out = Path(out_dir)
            adapter = lora_lib.adapter_state(self.peft, SHARDS)  # a gather: every rank
            if self.dp.rank == 0:
                write_adapter_folder(self.peft, out, self.model_path, adapter)
        out.mkdir(parents=True, exist_ok=True)
        r = self.dp.rank
        names = {id(p): n for n, p in self.model.named_parameters()}
        kept = self._checkpointed()
        shards = {n: self._local(p).detach().contiguous().cpu() for n, p in kept.items()}
        save_file(shards, str(out / f"model.rank{r}.safetensors"))
        optim = {
            names[id(p)]: {
                k: (self._local(v).cpu() if isinstance(v, torch.Tensor) else v) for k, v in st.items()
            }
            for p, st in self.optimizer.state.items()
        }
        save_state(out, f"optim.rank{r}", optim)
        save_state(
            out,
            f"extra_state.rank{r}",
            {
                "scheduler": self.scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps,
                "rng": get_rng_state(),
                "engine": "fsdp2",
            },
        )
        if r == 0:
            manifest = {
                "engine": "fsdp2",
                "world_size": self.dp.size,
                "lora_rank": self._lora_rank,
                "params": {
                    n: {
                        "shape": list(p.shape),
                        "rows": [list(_rows(p.shape[0], k, self.dp.size)) for k in range(self.dp.size)],
                    }
                    for n, p in kept.items()
                },
            }
            (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if dist.is_initialized():
            dist.barrier(group=self.dp.cpu_group)
        return out

    @torch.no_grad()
    def load(self, ckpt_dir: str | Path) -> None:
        """Restore this rank's shards (with LoRA: of the adapters; the frozen base is the model folder's),
        optimizer state, scheduler, counters and RNG (same world size and lora_rank only)."""
        from safetensors.torch import load_file

        from dapo_core.store.state_files import load_state

        d = Path(ckpt_dir)
        if not (d / MANIFEST).is_file():
            raise ShardedCheckpointMismatch(
                f"{d} has no {MANIFEST}: it was not written by the fsdp2 engine",
                where=str(d),
                fix="set actor_rollout_ref.actor.strategy to the engine that wrote it, or start a new run",
            )
        man = json.loads((d / MANIFEST).read_text())
        if int(man["world_size"]) != self.dp.size:
            raise ShardedCheckpointMismatch(
                f"checkpoint {d} holds the model in {man['world_size']} shards (one per data-parallel rank) "
                f"but this run has {self.dp.size} ranks; a sharded checkpoint resumes only at the world size "
                f"that wrote it (resharding is not supported)",
                where="trainer.n_gpus_per_node / trainer.nnodes",
                fix=(
                    f"set trainer.nnodes × trainer.n_gpus_per_node back to {man['world_size']} to resume, "
                    "or start a new run from the checkpoint's HF export (actor_rollout_ref.model.path)"
                ),
            )
        if int(man.get("lora_rank", 0)) != self._lora_rank:
            raise ShardedCheckpointMismatch(
                f"checkpoint {d} was written with actor_rollout_ref.model.lora_rank="
                f"{man.get('lora_rank', 0)} and this run has lora_rank={self._lora_rank} (a LoRA checkpoint "
                "holds only the adapters)",
                where="actor_rollout_ref.model.lora_rank",
                fix="set lora_rank (and lora_alpha, target_modules) as in the run that wrote it, or start a "
                "new run from the checkpoint's merged HF export (actor_rollout_ref.model.path)",
            )
        r = self.dp.rank
        shards = load_file(str(d / f"model.rank{r}.safetensors"))
        kept = self._checkpointed()
        if set(shards) != set(kept):
            diff = sorted(set(shards) ^ set(kept))[:3]
            raise ShardedCheckpointMismatch(
                f"checkpoint {d} holds parameters that differ from this model's ({diff})",
                where="actor_rollout_ref.model",
                fix="set the model path and the LoRA keys (target_modules, exclude_modules) as in the run "
                "that wrote it, or start a new run",
            )
        params = dict(self.model.named_parameters())
        for n, p in kept.items():
            self._local(p).copy_(shards[n])
        optim = load_state(d, f"optim.rank{r}")
        for n, st in optim.items():
            p = params[n]
            self.optimizer.state[p] = {
                k: (
                    DTensor.from_local(
                        v.to(self.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                    if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0
                    else (v.to(self.device) if isinstance(v, torch.Tensor) else v)
                )
                for k, v in st.items()
            }
        extra = load_state(d, f"extra_state.rank{r}")
        self.scheduler.load_state_dict(extra["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # the optimizer's own lr at save time (the scheduler set it last)
        self.optimizer_steps = int(extra["optimizer_steps"])
        self.skipped_steps = int(extra["skipped_steps"])
        set_rng_state(extra["rng"])


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks (`model.model.layers` in HF causal LMs), each its own FSDP unit."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def _single_process_group(device: str) -> dpd.DataParallel:
    """A process group of one for an fsdp2 engine outside a worker group (dp=1, in-process runs)."""
    if not dist.is_initialized():
        store = dpd.listen_store("127.0.0.1")
        dp = dpd.init_data_parallel(0, 1, "127.0.0.1", int(store.port), device, store=store)
        dpd.set_current(dp)
        return dp
    return dpd.DataParallel(rank=dist.get_rank(), size=dist.get_world_size())
