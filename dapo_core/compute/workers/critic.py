"""CriticWorker: a value model (the policy's backbone plus a scalar head) for GAE-based estimators.

Values follow verl's convention: the value of response token t is read from the hidden state of the position
before it (`values[:, P-1 : P+L-1]`), so V_t estimates the return from the state in which token t is chosen.
`update_critic` minimises the clipped value loss of docs/REFERENCE.md §2.3 with the same global token
normalisation as the actor (micro-batch split invariant). Gradient checkpointing follows the policy model's
switch; token-budget micro-batches and packed forwards are actor/reference features only (the critic's schema
section has no such keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import torch
from torch import nn

from dapo_core.algo.losses import compute_value_loss
from dapo_core.compute.engines.train import enable_gradient_checkpointing, minibatch_update
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
    ):
        """`gradient_checkpointing`: `actor_rollout_ref.model.enable_gradient_checkpointing` (the critic is
        the policy's backbone with a value head; our schema has no separate critic model section)."""
        torch.manual_seed(seed)
        self.cfg = dict(critic_cfg)
        self.pad_token_id = int(pad_token_id)
        self.n = int(rollout_n)
        self.seed = seed
        self.device = device
        self.model = _ValueModel(model_path, gradient_checkpointing).to(device)
        optim = dict(self.cfg.get("optim") or {})
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=float(optim.get("lr", 1e-5)),
            weight_decay=float(optim.get("weight_decay", 0.01)),
        )

    def _forward(self, t: dict) -> torch.Tensor:
        return self.model(
            t["input_ids"].to(self.device),
            t["attention_mask"].to(self.device),
            t["position_ids"].to(self.device),
            t["responses"].shape[1],
        )

    def compute_values(self, table: pa.Table) -> pa.Table:
        """Add `values` (one per response token)."""
        self.model.eval()
        with torch.no_grad():
            t = B.to_padded(table, self.pad_token_id)
            v = self._forward(t) * t["response_mask"].to(self.device)
        return B.add_token_column(table, "values", v, "float32")

    def values_stage(self, job: StageJob) -> tuple[str, dict[str, float]]:
        """`compute_values` on the view at `job.input_uri`, committed by this worker."""
        return run_job(job, lambda table: (self.compute_values(table), {}))

    def update_critic_from(self, root: str, uri: str, global_steps: int) -> dict[str, float]:
        """`update_critic` on the batch this worker reads from the run store at `uri` (run folder `root`)."""
        return self.update_critic(stage_files(root).read_uri(uri), global_steps)

    def update_critic(self, table: pa.Table, global_steps: int) -> dict[str, float]:
        """PPO value updates; returns `critic/vf_loss`, `critic/vf_clipfrac`, `critic/grad_norm`, `critic/lr`.

        The same mini-batch / micro-batch loop as the actor (`minibatch_update`); `critic/vf_loss` is summed
        over the micro-batches of a mini-batch (each is normalised by the mini-batch), then averaged.
        """
        self.model.train()
        t = B.to_padded(table, self.pad_token_id, columns=["values", "returns"])
        rows = table.num_rows
        mini = min(int(self.cfg.get("ppo_mini_batch_size") or max(rows // self.n, 1)) * self.n, rows)
        micro = int(self.cfg.get("ppo_micro_batch_size_per_gpu") or mini)
        mode = self.cfg.get("loss_agg_mode") or "token-mean"
        clip = float(self.cfg.get("cliprange_value") or 0.5)
        grad_clip = float(self.cfg.get("grad_clip") or 1.0)

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
        )
        metrics["critic/lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics

    def save_checkpoint(self, path: str) -> None:
        """Value model and optimizer state, as `critic.{json,tensors}` (safetensors + JSON, no pickle)."""
        import os

        from dapo_core.store.state_files import save_state

        os.makedirs(path, exist_ok=True)
        save_state(path, "critic", {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()})

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote (nothing read is executed; an older pickled `critic.pt` is
        refused)."""
        from dapo_core.store.state_files import load_state, refuse_pickled_state

        refuse_pickled_state(path, ("critic.pt",))
        state = load_state(path, "critic", device=str(self.device))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
