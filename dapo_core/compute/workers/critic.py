"""CriticWorker: a value model (the policy's backbone plus a scalar head) for GAE-based estimators.

Values follow verl's convention: the value of response token t is read from the hidden state of the position
before it (`values[:, P-1 : P+L-1]`), so V_t estimates the return from the state in which token t is chosen.
`update_critic` minimises the clipped value loss of docs/REFERENCE.md §2.3 with the same global token
normalisation as the actor (micro-batch split invariant).

The critic has the actor's memory features and schedule, all off by default (verl's `critic.*` keys):
gradient checkpointing (`critic.model.enable_gradient_checkpointing`, null = the policy model's switch),
token-budget micro-batches for updates and value forwards (`critic.use_dynamic_bsz` with
`ppo_max_token_len_per_gpu` / `forward_max_token_len_per_gpu`, via `dapo_core.compute.microbatch`), packed
forwards (`critic.model.use_remove_padding`) and the actor's AdamW arguments and warm-up / constant / cosine
lr schedule (`critic.optim`, stepped once per `update_critic` like the actor's once per update).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import torch
from torch import nn

from dapo_core.algo.losses import compute_value_loss
from dapo_core.compute.engines.train import (
    adamw_kwargs,
    enable_gradient_checkpointing,
    lr_lambda_for,
    minibatch_update,
)
from dapo_core.compute.microbatch import pack_rows, row_token_costs, token_budget_split
from dapo_core.compute.models import load_model
from dapo_core.data import batch as B
from dapo_core.store.jobs import StageJob, run_job, stage_files


class _ValueModel(nn.Module):
    def __init__(self, model_path: str, gradient_checkpointing: bool = False):
        super().__init__()
        lm = load_model(model_path)
        if gradient_checkpointing:
            enable_gradient_checkpointing(lm)
        self.backbone = lm.model  # the Qwen2 decoder without the LM head
        self.v_head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    def forward(self, input_ids, attention_mask, position_ids, response_length: int) -> torch.Tensor:
        h = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        v = self.v_head(h).squeeze(-1)
        return v[:, -response_length - 1 : -1]

    def forward_packed(self, input_ids, attention_mask, response_length: int) -> torch.Tensor:
        """The values of `forward` from one packed, padding-free pass over the valid tokens
        (`microbatch.pack_rows`): (B, L), 0 at padded response positions."""
        packed = pack_rows(input_ids, attention_mask, response_length)
        dev = self.v_head.weight.device
        h = self.backbone(
            input_ids=packed.input_ids.to(dev),
            position_ids=packed.position_ids.to(dev),
            attention_mask=None,
            use_cache=False,
        ).last_hidden_state[0]
        v = self.v_head(h[packed.logit_index.to(dev)]).squeeze(-1)
        return packed.scatter(v)


class CriticWorker:
    """Holds the value model and its optimizer. `critic_cfg` is the `critic` config section as a dict."""

    def __init__(
        self,
        model_path: str,
        critic_cfg: Mapping[str, Any],
        *,
        pad_token_id: int,
        rollout_n: int,
        device: str = "cpu",
        seed: int = 0,
        gradient_checkpointing: bool = False,
        total_steps: int = 1,
    ):
        """`gradient_checkpointing`: the policy model's switch
        (`actor_rollout_ref.model.enable_gradient_checkpointing`), used when
        `critic.model.enable_gradient_checkpointing` is null. `total_steps`: lr-schedule length (one step per
        `update_critic`; the flow passes the actor's). Null `use_dynamic_bsz` (the actor's, resolved by the
        flow) counts as off here."""
        torch.manual_seed(seed)
        self.cfg = dict(critic_cfg)
        model_cfg = dict(self.cfg.get("model") or {})
        ckpt = model_cfg.get("enable_gradient_checkpointing")
        self.gradient_checkpointing = bool(gradient_checkpointing if ckpt is None else ckpt)
        self.remove_padding = bool(model_cfg.get("use_remove_padding", False))
        self.pad_token_id = int(pad_token_id)
        self.n = int(rollout_n)
        self.seed = seed
        self.device = device
        self.model = _ValueModel(model_path, self.gradient_checkpointing).to(device)
        optim = {"lr": 1e-5, **dict(self.cfg.get("optim") or {})}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **adamw_kwargs(optim, "critic.optim"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda_for(optim, int(total_steps), "critic.optim")
        )

    @property
    def update_max_token_len(self) -> int | None:
        """The update's micro-batch token budget (`ppo_max_token_len_per_gpu` when `use_dynamic_bsz`)."""
        if not self.cfg.get("use_dynamic_bsz"):
            return None
        return int(self.cfg.get("ppo_max_token_len_per_gpu") or 32768)

    @property
    def forward_max_token_len(self) -> int | None:
        """The value forward's token budget (`forward_max_token_len_per_gpu`, null = the update's)."""
        if not self.cfg.get("use_dynamic_bsz"):
            return None
        fwd = self.cfg.get("forward_max_token_len_per_gpu")
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
        longest row (or packed); the rows come back in the table's order."""
        self.model.eval()
        budget = self.forward_max_token_len
        if budget is None:
            with torch.no_grad():
                t = B.to_padded(table, self.pad_token_id)
                v = self._forward(t) * t["response_mask"].to(self.device)
            return B.add_token_column(table, "values", v, "float32")
        prompt_lens = B.prompt_lengths(table).astype("int64")
        response_lens = B.response_lengths(table).astype("int64")
        if self.remove_padding:
            costs = [int(x) for x in prompt_lens + response_lens]
        else:  # the padded width of the batch
            costs = [int(prompt_lens.max(initial=0) + response_lens.max(initial=0))] * table.num_rows
        chunks, order = [], []
        with torch.no_grad():
            for group in token_budget_split(costs, budget):
                part = table.take(pa.array(group, type=pa.int64()))
                t = B.to_padded(part, self.pad_token_id)
                v = self._forward(t) * t["response_mask"].to(self.device)
                chunks.append(B.from_padded(v, B.response_lengths(part), dtype="float32"))
                order.extend(group)
        col = pa.concat_arrays(chunks).take(pa.array(torch.argsort(torch.tensor(order)).numpy()))
        return B.set_column(table, "values", col)

    def values_stage(self, job: StageJob) -> tuple[str, dict[str, float]]:
        """`compute_values` on the view at `job.input_uri`, committed by this worker."""
        return run_job(job, lambda table: (self.compute_values(table), {}))

    def update_critic_from(self, root: str, uri: str, global_steps: int) -> dict[str, float]:
        """`update_critic` on the batch this worker reads from the run store at `uri` (run folder `root`)."""
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
        mini = min(int(self.cfg.get("ppo_mini_batch_size") or max(rows // self.n, 1)) * self.n, rows)
        micro = int(self.cfg.get("ppo_micro_batch_size_per_gpu") or mini)
        mode = self.cfg.get("loss_agg_mode") or "token-mean"
        clip = float(self.cfg.get("cliprange_value") or 0.5)
        grad_clip = float(self.cfg.get("grad_clip") or 1.0)
        budget = self.update_max_token_len

        def micro_loss(mb: dict, info: dict) -> tuple[torch.Tensor, dict]:
            vpreds = self._forward(mb)
            loss, clipfrac = compute_value_loss(
                vpreds, mb["returns"], mb["values"], mb["response_mask"], clip, loss_agg_mode=mode, **info
            )
            return loss, {"critic/vf_loss": loss, "critic/vf_clipfrac": clipfrac}

        def optimizer_step() -> dict[str, float]:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
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
            epochs=int(self.cfg.get("ppo_epochs") or 1),
            shuffle=bool(self.cfg.get("shuffle")),
            seed=self.seed + int(global_steps),
            sum_keys=("critic/vf_loss",),
            token_budget=budget,
            row_tokens=row_token_costs(t["attention_mask"], self.remove_padding)
            if budget is not None
            else None,
        )
        metrics["critic/lr"] = lr
        self.scheduler.step()
        return metrics

    def save_checkpoint(self, path: str) -> None:
        """Value model, optimizer and lr-schedule state, as `critic.{json,tensors}` (safetensors + JSON, no
        pickle)."""
        import os

        from dapo_core.store.state_files import save_state

        os.makedirs(path, exist_ok=True)
        save_state(
            path,
            "critic",
            {
                "model": self.model.state_dict(),
                "optim": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            },
        )

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote (nothing read is executed; an older pickled `critic.pt` is
        refused)."""
        from dapo_core.store.state_files import load_state, refuse_pickled_state

        refuse_pickled_state(path, ("critic.pt",))
        state = load_state(path, "critic", device=str(self.device))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        if "scheduler" in state:  # checkpoints before the critic had a schedule: its lr was constant
            self.scheduler.load_state_dict(state["scheduler"])
