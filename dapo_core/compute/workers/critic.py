"""CriticWorker: a value model (the policy's backbone plus a scalar head) for GAE-based estimators.

Values follow verl's convention: the value of response token t is read from the hidden state of the position
before it (`values[:, P-1 : P+L-1]`), so V_t estimates the return from the state in which token t is chosen.
`update_critic` minimises the clipped value loss of docs/REFERENCE.md §2.3 with the same global token
normalisation as the actor (micro-batch split invariant).

The critic has the actor's memory features and schedule under verl's `critic.*` keys, all off by default:
gradient checkpointing (null = the policy model's switch), token-budget micro-batches (`use_dynamic_bsz`),
packed forwards (`model.use_remove_padding`), AdamW and the lr schedule (`optim`, one step per update).
With data-parallel ranks (the worker runs in a group, `dist.current()`) the value model is built on the meta
device and sharded with FSDP2, each rank reading only its rows of the weights; each rank computes the values
of its rows (`dist.dp_split`) and rank 0 gathers them, the update splits every mini-batch over the ranks with
the loss normalised over the whole mini-batch, and checkpoints are per rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import torch
from torch import nn

from dapo_core.algo.losses import compute_value_loss
from dapo_core.compute import dist as dpd
from dapo_core.compute.engines.fsdp2_train import load_hf_shards, materialize, parameters_on_meta
from dapo_core.compute.engines.ppo import minibatch_update
from dapo_core.compute.engines.train import (
    adamw_kwargs,
    enable_gradient_checkpointing,
    lr_lambda_for,
)
from dapo_core.compute.faults import fault_point
from dapo_core.compute.microbatch import pack_rows, row_token_costs, token_budget_split
from dapo_core.compute.models import load_model
from dapo_core.compute.varlen_attention import packed_attention
from dapo_core.config import CriticConfig, section
from dapo_core.data import batch as B
from dapo_core.store.jobs import StageJob, run_job, stage_files


class _ValueModel(nn.Module):
    def __init__(
        self, model_path: str, gradient_checkpointing: bool = False, *, weights: bool = True
    ) -> None:
        """The backbone of the HF model at `model_path` and a zero value head; `weights=False` builds it
        from the folder's config alone (inside `parameters_on_meta`, for `sharded`)."""
        super().__init__()
        if weights:
            lm = load_model(model_path)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(model_path)
            lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        if gradient_checkpointing:
            enable_gradient_checkpointing(lm)
        self.backbone = lm.model  # the Qwen2 decoder without the LM head
        self.v_head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_length: int,
    ) -> torch.Tensor:
        h = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        v = self.v_head(h).squeeze(-1)
        return v[:, -response_length - 1 : -1].clone()  # not a view: FSDP2 hooks the output for backward

    def forward_packed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
    ) -> torch.Tensor:
        """The values of `forward` from one packed, padding-free pass over the valid tokens
        (`microbatch.pack_rows`, attention within each row by `varlen_attention.packed_attention`): (B, L), 0
        at padded response positions."""
        packed = pack_rows(input_ids, attention_mask, response_length)
        dev = self.v_head.weight.device
        with packed_attention(self.backbone, packed.cu_seqlens, packed.max_seqlen, dev) as varlen:
            h = self.backbone(
                input_ids=packed.input_ids.to(dev),
                position_ids=packed.position_ids.to(dev),
                attention_mask=None,
                use_cache=False,
                **varlen,
            ).last_hidden_state[0]
        v = self.v_head(h[packed.logit_index.to(dev)]).squeeze(-1)
        return packed.scatter(v)

    @classmethod
    def sharded(
        cls, model_path: str, gradient_checkpointing: bool, dp: dpd.DataParallel, device: str
    ) -> _ValueModel:
        """The value model built on the meta device, sharded over `dp`, and each rank's rows of the backbone
        read from the folder's safetensors: no rank holds the whole model."""
        from pathlib import Path

        with parameters_on_meta():
            model = cls(model_path, gradient_checkpointing, weights=False)
        model.shard(dp, device)
        materialize(model, device)
        load_hf_shards(model.backbone, Path(model_path), dp.rank, dp.size, prefix="model.")
        with torch.no_grad():
            for p in model.v_head.parameters():
                _local(p).zero_()
        model.eval()
        return model

    def shard(self, dp: dpd.DataParallel, device: str) -> None:
        """Shard the parameters over `dp`'s ranks with FSDP2: each decoder layer, then the whole model."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda" if device == "cuda" else "cpu", (dp.size,))
        for layer in getattr(self.backbone, "layers", []):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly) sharded tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class CriticWorker:
    """Holds the value model and its optimizer. `critic_cfg` is the `critic` section (`CriticConfig`; a
    mapping is read as one, with the schema's defaults for what it leaves out)."""

    def __init__(
        self,
        model_path: str,
        critic_cfg: CriticConfig | Mapping[str, Any],
        *,
        pad_token_id: int,
        rollout_n: int,
        device: str = "cpu",
        seed: int = 0,
        gradient_checkpointing: bool = False,
        total_steps: int = 1,
        shuffle: bool = False,
    ) -> None:
        """`gradient_checkpointing`: the policy model's switch
        (`actor_rollout_ref.model.enable_gradient_checkpointing`), used when
        `critic.model.enable_gradient_checkpointing` is null. `total_steps`: lr-schedule length (one step per
        `update_critic`; the flow passes the actor's). `shuffle`: the actor's `shuffle` (rows between
        epochs). Null `use_dynamic_bsz` (the actor's, resolved by the flow) counts as off here."""
        torch.manual_seed(seed)
        self.cfg = section(CriticConfig, critic_cfg)
        self.shuffle = bool(shuffle)
        ckpt = self.cfg.model.enable_gradient_checkpointing
        self.gradient_checkpointing = bool(gradient_checkpointing if ckpt is None else ckpt)
        self.remove_padding = bool(self.cfg.model.use_remove_padding)
        self.pad_token_id = int(pad_token_id)
        self.n = int(rollout_n)
        self.seed = seed
        self.device = device
        self.dp = dpd.current()
        self.sharded = self.dp is not None and self.dp.size > 1
        if self.sharded:
            assert self.dp is not None
            self.model = _ValueModel.sharded(model_path, self.gradient_checkpointing, self.dp, device)
        else:
            self.model = _ValueModel(model_path, self.gradient_checkpointing).to(device)
        optim = self.cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **adamw_kwargs(optim, "critic.optim"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda_for(optim, int(total_steps), "critic.optim")
        )

    @property
    def update_max_token_len(self) -> int | None:
        """The update's micro-batch token budget (`ppo_max_token_len_per_gpu` when `use_dynamic_bsz`)."""
        if not self.cfg.use_dynamic_bsz:
            return None
        return int(self.cfg.ppo_max_token_len_per_gpu)

    @property
    def forward_max_token_len(self) -> int | None:
        """The value forward's token budget (`forward_max_token_len_per_gpu`, null = the update's)."""
        if not self.cfg.use_dynamic_bsz:
            return None
        fwd = self.cfg.forward_max_token_len_per_gpu
        return int(fwd) if fwd is not None else self.update_max_token_len

    def _forward(self, t: dict) -> torch.Tensor:
        if self.remove_padding:
            return self.model.forward_packed(t["input_ids"], t["attention_mask"], t["responses"].shape[1])
        return self.model(
            t["input_ids"].to(self.device),
            t["attention_mask"].to(self.device),
            t["position_ids"].to(self.device),
            t["responses"].shape[1],
        )

    def compute_values(self, table: pa.Table) -> pa.Table:
        """Add `values` (one per response token).

        One forward over the batch, or, with a token budget (`forward_max_token_len`), micro-batches from
        `token_budget_split` over what each row costs the forward (`row_token_costs`), each padded to its own
        longest row (or packed); the rows come back in the table's order. With data-parallel ranks each
        computes its rows (`dist.dp_split` by tokens, a `uid` group together) and rank 0 returns the whole
        table; the other ranks return `table` unchanged."""
        if not self.sharded:
            return B.set_column(table, "values", self._values(table))
        assert self.dp is not None
        costs = (B.prompt_lengths(table).astype("int64") + B.response_lengths(table).astype("int64")).tolist()
        uid = table.column("uid").to_pylist() if "uid" in table.column_names else None
        parts = dpd.dp_split(costs, self.dp.size, uid)
        mine = table.take(pa.array(parts[self.dp.rank], type=pa.int64()))
        full = dpd.gather_table(
            self.dp, pa.table({"v": self._values(mine, pad_row=table.slice(0, 1))}), parts
        )
        return table if full is None else B.set_column(table, "values", full.column("v").combine_chunks())

    def _values(self, table: pa.Table, pad_row: pa.Table | None = None) -> pa.Array:
        """The `values` column of `table`'s rows. With data-parallel ranks every rank runs as many forwards
        as the busiest one (the missing ones on `pad_row`, dropped): a sharded forward is a collective."""
        self.model.eval()
        budget = self.forward_max_token_len
        if budget is None:
            groups = [list(range(table.num_rows))] if table.num_rows else []
        else:
            prompt_lens = B.prompt_lengths(table).astype("int64")
            response_lens = B.response_lengths(table).astype("int64")
            if self.remove_padding:
                costs = [int(x) for x in prompt_lens + response_lens]
            else:  # the padded width of the batch
                costs = [int(prompt_lens.max(initial=0) + response_lens.max(initial=0))] * table.num_rows
            groups = token_budget_split(costs, budget)
        chunks, order = [], []
        padding = 0 if not self.sharded or self.dp is None else self.dp.max_int(len(groups)) - len(groups)
        with torch.no_grad():
            for _ in range(padding):
                assert pad_row is not None
                self._forward(B.to_padded(pad_row, self.pad_token_id))
            for group in groups:
                part = table.take(pa.array(group, type=pa.int64()))
                t = B.to_padded(part, self.pad_token_id)
                v = self._forward(t) * t["response_mask"].to(self.device)
                chunks.append(B.from_padded(v, B.response_lengths(part), dtype="float32"))
                order.extend(group)
        if not order:
            return pa.array([], type=pa.list_(pa.float32()))
        return pa.concat_arrays(chunks).take(pa.array(torch.argsort(torch.tensor(order)).numpy()))

    def values_stage(self, job: StageJob) -> tuple[str, dict[str, float]]:
        """`compute_values` on the view at `job.input_uri`, committed by this worker (rank 0; the other
        ranks compute their share and return ("", {}))."""
        fault_point(job.root, job.stage, job.step)
        if self.dp is not None and self.dp.rank != 0:
            self.compute_values(job.read())
            return "", {}
        return run_job(job, lambda table: (self.compute_values(table), {}))

    def update_critic_from(self, root: str, uri: str, global_steps: int) -> dict[str, float]:
        """`update_critic` on the batch this worker reads from the run store at `uri` (run folder `root`)."""
        fault_point(root, "update_critic", global_steps)
        return self.update_critic(stage_files(root).read_uri(uri), global_steps)

    def update_critic(self, table: pa.Table, global_steps: int) -> dict[str, float]:
        """PPO value updates; returns `critic/vf_loss`, `critic/vf_clipfrac`, `critic/grad_norm`, `critic/lr`
        (the lr of this update) and steps the lr schedule once.

        The same mini-batch / micro-batch loop as the actor (`minibatch_update`); `critic/vf_loss` is summed
        over the micro-batches of a mini-batch (each is normalised by the mini-batch), then averaged. With a
        token budget the micro-batches are `token_budget_split` groups; the normalisation is the same.
        """
        self.model.train()
        t = B.to_padded(table, self.pad_token_id, columns=["values", "returns"])
        rows = table.num_rows
        # null batch settings (not resolved to the actor's by the flow): one mini-batch, one epoch
        mini = min(int(self.cfg.ppo_mini_batch_size or max(rows // self.n, 1)) * self.n, rows)
        micro = int(self.cfg.ppo_micro_batch_size_per_gpu or mini)
        mode = self.cfg.loss_agg_mode
        clip = float(self.cfg.cliprange_value)
        grad_clip = float(self.cfg.grad_clip)
        budget = self.update_max_token_len

        def micro_loss(mb: dict, info: dict) -> tuple[torch.Tensor, dict]:
            vpreds = self._forward(mb)
            loss, clipfrac = compute_value_loss(
                vpreds, mb["returns"], mb["values"], mb["response_mask"], clip, loss_agg_mode=mode, **info
            )
            return loss, {"critic/vf_loss": loss, "critic/vf_clipfrac": clipfrac}

        def optimizer_step() -> dict[str, float]:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
            if self.sharded:  # the global norm over every rank's shards, the same on each rank
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            if torch.isfinite(norm):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return {"critic/grad_norm": float(norm)}

        self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.optimizer.param_groups[0]["lr"])
        metrics = minibatch_update(
            t,
            micro_loss=micro_loss,
            backward=lambda loss: loss.backward(),
            optimizer_step=optimizer_step,
            device=self.device,
            mini_batch_size=mini,
            micro_batch_size=micro,
            epochs=int(self.cfg.ppo_epochs or 1),
            shuffle=self.shuffle,
            seed=self.seed + int(global_steps),
            sum_keys=("critic/vf_loss",),
            token_budget=budget,
            row_tokens=row_token_costs(t["attention_mask"], self.remove_padding)
            if budget is not None
            else None,
            dp=self.dp,
        )
        metrics["critic/lr"] = lr
        self.scheduler.step()
        return metrics

    def save_checkpoint(self, path: str) -> None:
        """Value model, optimizer and lr-schedule state, as `critic.{json,tensors}` (safetensors + JSON, no
        pickle); with data-parallel ranks each rank writes its shards as `critic.rank<r>.{json,tensors}` and
        rank 0 `critic_fsdp2.json` (the world size)."""
        from dapo_core.store.state_files import save_state

        os.makedirs(path, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        if not self.sharded:
            save_state(path, "critic", state)
            return
        assert self.dp is not None
        state["model"] = {k: _local(v).detach().cpu() for k, v in state["model"].items()}
        state["optim"]["state"] = {
            i: {k: (_local(v).cpu() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
            for i, st in state["optim"]["state"].items()
        }
        save_state(path, f"critic.rank{self.dp.rank}", state)
        if self.dp.rank == 0:
            with open(os.path.join(path, SHARDED_MANIFEST), "w") as f:
                json.dump({"engine": "fsdp2", "world_size": self.dp.size}, f)
        torch.distributed.barrier(group=self.dp.cpu_group)

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote (nothing read is executed; an older pickled `critic.pt` is
        refused; sharded state only at the world size that wrote it)."""
        from dapo_core.store.state_files import load_state, refuse_pickled_state

        refuse_pickled_state(path, ("critic.pt",))
        _check_world_size(path, self.dp.size if self.sharded and self.dp is not None else 1)
        if not self.sharded:
            state = load_state(path, "critic", device=str(self.device))
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
            if "scheduler" in state:  # a checkpoint without scheduler state keeps a constant lr
                self.scheduler.load_state_dict(state["scheduler"])
            return
        assert self.dp is not None
        state = load_state(path, f"critic.rank{self.dp.rank}", device=str(self.device))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                _local(p).copy_(state["model"][n])
        by_index = [p for group in self.optimizer.param_groups for p in group["params"]]
        optim = state["optim"]
        optim["state"] = {
            i: {k: _like(by_index[int(i)], v) for k, v in st.items()} for i, st in optim["state"].items()
        }
        self.optimizer.load_state_dict(optim)
        self.scheduler.load_state_dict(state["scheduler"])


SHARDED_MANIFEST = "critic_fsdp2.json"
"""Written next to a sharded critic checkpoint: the number of ranks that wrote it."""


def _check_world_size(path: str, size: int) -> None:
    """Refuse a critic checkpoint written by a different number of data-parallel ranks."""
    from dapo_core.compute.engines.fsdp2_train import ShardedCheckpointMismatch

    manifest = os.path.join(path, SHARDED_MANIFEST)
    saved = 1
    if os.path.isfile(manifest):
        with open(manifest) as f:
            saved = int(json.load(f)["world_size"])
    if saved != size:
        raise ShardedCheckpointMismatch(
            f"critic checkpoint {path} was written by {saved} data-parallel rank(s) but this run's critic "
            f"has {size}; a critic checkpoint resumes only at the world size that wrote it (no resharding)",
            where="trainer.n_gpus_per_node / trainer.nnodes",
            fix=f"set trainer.nnodes × trainer.n_gpus_per_node back to {saved} to resume, or start a new run",
        )


def _like(p: torch.Tensor, v: object) -> object:
    """Saved optimizer state `v` (a local shard) shaped like parameter `p` (a DTensor when sharded)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(v, torch.Tensor):
        return v
    if isinstance(p, DTensor) and v.dim() > 0:
        return DTensor.from_local(
            v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    return v.to(p.device)
