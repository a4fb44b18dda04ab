"""ActorWorker and RefWorker: the policy being trained and the frozen reference policy (with LoRA the actor
serves the reference itself, its adapters off, and no RefWorker starts).

The actor recomputes `old_log_probs` (decoupled mode), runs the PPO mini-batch/epoch loop with the configured
policy loss (DAPO: `vanilla` with clip-higher and dual clip, token-mean over the global mini-batch), and
exports weights for the rollout engine. Memory features (gradient checkpointing, token-budget micro-batches
for log-probs and updates, packed forwards) are off unless the config turns them on. The objective is
docs/REFERENCE.md §1.4:
`pg_loss − entropy_coeff·agg(entropy) + kl_loss_coef·agg(kl_penalty(logp, ref_logp))`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa
import torch

from dapo_core.algo.losses import ActorLoss, PiOld, PolicyLossParams, agg_loss
from dapo_core.compute import dist as dpd
from dapo_core.compute.engines.ppo import ppo_update
from dapo_core.compute.engines.train import TrainEngine, make_train_engine
from dapo_core.compute.faults import fault_point
from dapo_core.compute.lora import LoraSpec
from dapo_core.compute.microbatch import grouped_order, token_budget_split
from dapo_core.config import ActorConfig, RolloutCorrectionConfig, section
from dapo_core.config.checks import train_dtype
from dapo_core.data import batch as B
from dapo_core.store.jobs import StageJob, run_job, stage_files


def _log_prob_table(
    engine: TrainEngine,
    table: pa.Table,
    *,
    pad_token_id: int,
    temperature: float,
    micro_batch_size: int | None,
    calculate_entropy: bool,
    max_token_len: int | None = None,
    remove_padding: bool = False,
    share_prompt: bool = False,
    dp: dpd.DataParallel | None = None,
    pad_row: pa.Table | None = None,
) -> tuple[pa.Array, pa.Array | None]:
    """Teacher-forced log-probs (and entropy) of every row's response as list<float32> columns.

    Micro-batches hold `micro_batch_size` rows (null = all), or, with `max_token_len` (a `*_use_dynamic_bsz`
    budget), rows grouped by `token_budget_split` over what each costs the forward (`row_token_costs`);
    each micro-batch is padded to its own longest row, or packed with `remove_padding`; with `share_prompt`
    each distinct prompt of a micro-batch runs once (`TrainEngine.forward`), and fixed-size micro-batches
    take the rows of a prompt together, longest groups first (`grouped_order`). The output rows are in the
    table's order whatever the grouping.

    With `dp` (this is one rank's share of a stage), every rank runs as many forwards as the busiest one:
    the missing ones run on `pad_row` and are dropped (a sharded model's forward is a collective).
    """
    engine.eval()
    lengths = torch.tensor(B.response_lengths(table), dtype=torch.long)
    rows = table.num_rows
    if max_token_len is None:
        mbs = micro_batch_size or rows
        row_order = list(range(rows))
        if share_prompt:  # whole prompt groups per micro-batch, whatever order the batch is in
            keys: dict[tuple[int, ...], int] = {}
            prompt_of = [keys.setdefault(tuple(p), len(keys)) for p in table.column("prompt_ids").to_pylist()]
            row_order = grouped_order(torch.tensor(prompt_of, dtype=torch.long), lengths).tolist()
        groups = [row_order[start : start + mbs] for start in range(0, rows, mbs)]
    else:
        seq_lens = B.prompt_lengths(table).astype("int64") + B.response_lengths(table).astype("int64")
        if remove_padding:
            costs = [int(x) for x in seq_lens]
        else:
            width = int(B.prompt_lengths(table).max(initial=0)) + int(
                B.response_lengths(table).max(initial=0)
            )
            costs = [width] * rows
        groups = token_budget_split(costs, max_token_len)
    logps, ents = [], []
    order: list[int] = []
    padding = 0 if dp is None else dp.max_int(len(groups)) - len(groups)
    with torch.no_grad():
        for _ in range(padding):
            assert pad_row is not None
            t = B.to_padded(pad_row, pad_token_id)
            engine.forward(
                t["input_ids"],
                t["attention_mask"],
                t["position_ids"],
                t["responses"].shape[1],
                temperature=temperature,
                remove_padding=remove_padding,
            )
        for group in groups:
            part = table.take(pa.array(group, type=pa.int64()))
            t = B.to_padded(part, pad_token_id)
            lp, ent = engine.forward(
                t["input_ids"],
                t["attention_mask"],
                t["position_ids"],
                t["responses"].shape[1],
                temperature=temperature,
                calculate_entropy=calculate_entropy,
                remove_padding=remove_padding,
                share_prompt=share_prompt,
            )
            logps.append(lp)
            if calculate_entropy:
                ents.append(ent)
            order.extend(group)
    if not order:
        empty = pa.array([], type=pa.list_(pa.float32()))
        return empty, (empty if calculate_entropy else None)
    order_t = torch.tensor(order, dtype=torch.long)
    lp_col = _to_list_column(logps, lengths[order_t])
    # with calculate_entropy every chunk in `ents` is a tensor
    ent_col = _to_list_column(ents, lengths[order_t]) if calculate_entropy else None  # type: ignore[arg-type]
    if order != sorted(order):  # token-budget groups: back to the table's row order
        restore = pa.array(torch.argsort(order_t).numpy())
        lp_col = lp_col.take(restore)
        ent_col = ent_col.take(restore) if ent_col is not None else None
    return lp_col, ent_col


def _to_list_column(chunks: list[torch.Tensor], lengths: torch.Tensor) -> pa.Array:
    """One list<float32> column from micro-batch chunks of different padded widths (no Python round trip)."""
    out, pos = [], 0
    for c in chunks:
        out.append(B.from_padded(c, lengths[pos : pos + c.shape[0]], dtype="float32"))
        pos += c.shape[0]
    return pa.concat_arrays(out)


def _sharded_log_prob_table(
    engine: TrainEngine, table: pa.Table, dp: dpd.DataParallel | None, **kwargs: Any
) -> tuple[pa.Array | None, pa.Array | None]:
    """`_log_prob_table` over the data-parallel ranks: each computes its rows (`dist.dp_split` by tokens,
    a prompt's `uid` group together) and rank 0 gathers the columns in the table's order; the other ranks
    get (None, None). Without `dp` (or with one rank) it is `_log_prob_table` itself."""
    if dp is None or dp.size == 1:
        return _log_prob_table(engine, table, **kwargs)
    costs = (B.prompt_lengths(table).astype("int64") + B.response_lengths(table).astype("int64")).tolist()
    uid = table.column("uid").to_pylist() if "uid" in table.column_names else None
    parts = dpd.dp_split(costs, dp.size, uid)
    mine = table.take(pa.array(parts[dp.rank], type=pa.int64()))
    lp, ent = _log_prob_table(engine, mine, dp=dp, pad_row=table.slice(0, 1), **kwargs)
    cols = {"lp": lp, **({"ent": ent} if ent is not None else {})}
    full = dpd.gather_table(dp, pa.table(cols), parts)
    if full is None:
        return None, None
    lp_all = full.column("lp").combine_chunks()
    return lp_all, (full.column("ent").combine_chunks() if "ent" in full.column_names else None)


def _with_ref_log_probs(
    engine: TrainEngine, table: pa.Table, dp: dpd.DataParallel | None, **kwargs: Any
) -> pa.Table:
    """`table` with `ref_log_probs` from `engine`'s forward (no entropy); with data-parallel ranks, on rank
    0 (the others get `table` back unchanged). `kwargs`: `_log_prob_table`'s micro-batch and padding
    settings."""
    logps, _ = _sharded_log_prob_table(engine, table, dp, calculate_entropy=False, **kwargs)
    return table if logps is None else B.set_column(table, "ref_log_probs", logps)


def _ref_stage(
    job: StageJob, dp: dpd.DataParallel | None, compute: Callable[[pa.Table], pa.Table]
) -> tuple[str, dict[str, float]]:
    """The ref stage: `compute` on the view at `job.input_uri`, committed by this worker (rank 0; the other
    ranks compute their share and return ("", {}))."""
    fault_point(job.root, job.stage, job.step)
    if dp is not None and dp.rank != 0:
        compute(job.read())
        return "", {}
    return run_job(job, lambda table: (compute(table), {}))


def mixed_precision(cfg: ActorConfig) -> tuple[torch.dtype | None, torch.dtype | None]:
    """`make_train_engine`'s (`compute_dtype`, `reduce_dtype`) from `actor.fsdp_config.mixed_precision`
    (None, None for the deepspeed engine, which reads its own `deepspeed.bf16`)."""
    if cfg.strategy == "deepspeed":
        return None, None
    mp = cfg.fsdp_config.mixed_precision
    return getattr(torch, train_dtype(mp.param_dtype)), getattr(torch, train_dtype(mp.reduce_dtype))


class ActorWorker:
    """The trained policy. `actor_cfg` is the `actor_rollout_ref.actor` section (`ActorConfig`; a mapping is
    read as one, with the schema's defaults for what it leaves out)."""

    def __init__(
        self,
        model_path: str,
        actor_cfg: ActorConfig | Mapping[str, Any],
        *,
        pad_token_id: int,
        temperature: float,
        rollout_n: int,
        total_steps: int,
        device: str = "cpu",
        seed: int = 0,
        log_prob_micro_batch_size: int | None = None,
        rollout_correction: RolloutCorrectionConfig | Mapping[str, Any] | None = None,
        log_prob_max_token_len: int | None = None,
        gradient_checkpointing: bool = False,
        use_remove_padding: bool = False,
        use_shared_prompt: bool = False,
        lora: LoraSpec | None = None,
    ) -> None:
        """`log_prob_max_token_len`: the token budget of old-log-prob micro-batches (rollout's
        `log_prob_max_token_len_per_gpu` when `log_prob_use_dynamic_bsz`, else None); the update's budget is
        `actor_cfg`'s `ppo_max_token_len_per_gpu` when its `use_dynamic_bsz`. `gradient_checkpointing`,
        `use_remove_padding` and `use_shared_prompt` are `actor_rollout_ref.model`'s switches; `lora` its
        LoRA keys (only the adapters train, and this worker also serves the reference log-probs)."""
        self.cfg = section(ActorConfig, actor_cfg)
        self.dp = dpd.current()
        self.log_prob_max_token_len = log_prob_max_token_len
        self.remove_padding = bool(use_remove_padding)
        # a sharded forward must be one module call on every rank: no shared-prompt forward under fsdp2
        self.shared_prompt = bool(use_shared_prompt) and self.cfg.strategy != "fsdp2"
        self.pad_token_id = int(pad_token_id)
        self.temperature = float(temperature)
        self.n = int(rollout_n)
        self.seed = int(seed)
        self.log_prob_mbs = log_prob_micro_batch_size
        compute_dtype, reduce_dtype = mixed_precision(self.cfg)
        self.engine = make_train_engine(
            self.cfg.strategy,
            model_path,
            self.cfg.optim,
            total_steps=total_steps,
            grad_clip=float(self.cfg.grad_clip),
            device=device,
            deepspeed_cfg=dataclasses.asdict(self.cfg.deepspeed),
            seed=seed,
            gradient_checkpointing=gradient_checkpointing,
            compute_dtype=compute_dtype,
            reduce_dtype=reduce_dtype,
            lora=lora,
        )
        pl = dataclasses.asdict(self.cfg.policy_loss)
        loss_mode = pl.pop("loss_mode")
        known = {f.name for f in dataclasses.fields(PolicyLossParams)}
        cfg = self.cfg
        rc = None if rollout_correction is None else section(RolloutCorrectionConfig, rollout_correction)
        params = PolicyLossParams(
            **{
                **{k: v for k, v in pl.items() if k in known},
                "clip_ratio_low": cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio,
                "clip_ratio_high": cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio,
                "clip_ratio_c": cfg.clip_ratio_c,
                **({"rollout_correction": dataclasses.asdict(rc)} if rc is not None else {}),
            }
        )
        self.bypass = loss_mode == "bypass_mode"
        self.loss = ActorLoss(
            loss_mode=loss_mode,
            params=params,
            loss_agg_mode=cfg.loss_agg_mode,
            entropy_coeff=float(cfg.entropy_coeff),
            use_kl_loss=bool(cfg.use_kl_loss),
            kl_loss_coef=float(cfg.kl_loss_coef),
            kl_loss_type=cfg.kl_loss_type,
            loss_scale_factor=cfg.loss_scale_factor,
        )
        """The update's loss of one micro-batch (`ppo_update` calls it; no state of this worker)."""

    # -- log-probs -------------------------------------------------------------------------------------------
    def compute_log_prob(self, table: pa.Table, calculate_entropy: bool = True) -> pa.Table:
        """Add `old_log_probs` (and `entropy`) computed by the current weights. With data-parallel ranks each
        computes its share and rank 0 returns the whole table; the other ranks return `table` unchanged."""
        logps, ents = _sharded_log_prob_table(
            self.engine,
            table,
            self.dp,
            pad_token_id=self.pad_token_id,
            temperature=self.temperature,
            micro_batch_size=self.log_prob_mbs,
            calculate_entropy=calculate_entropy,
            max_token_len=self.log_prob_max_token_len,
            remove_padding=self.remove_padding,
            share_prompt=self.shared_prompt,
        )
        if logps is None:
            return table
        table = B.set_column(table, "old_log_probs", logps)
        if ents is not None:
            table = B.set_column(table, "entropy", ents)
        return table

    def compute_ref_log_prob(self, table: pa.Table) -> pa.Table:
        """Add `ref_log_probs`: the forward of a LoRA actor with its adapters off (the base model, verl's
        reference in the actor), with the old-log-prob stage's micro-batches."""
        with self.engine.ref_mode():
            return _with_ref_log_probs(
                self.engine,
                table,
                self.dp,
                pad_token_id=self.pad_token_id,
                temperature=self.temperature,
                micro_batch_size=self.log_prob_mbs,
                max_token_len=self.log_prob_max_token_len,
                remove_padding=self.remove_padding,
                share_prompt=self.shared_prompt,
            )

    def ref_log_prob_stage(self, job: StageJob) -> tuple[str, dict[str, float]]:
        """The ref stage run by a LoRA actor (`compute_ref_log_prob` on the view at `job.input_uri`,
        committed by this worker): what `RefWorker.ref_log_prob_stage` does without a second model."""
        return _ref_stage(job, self.dp, self.compute_ref_log_prob)

    def log_prob_stage(
        self, job: StageJob, *, entropy_agg_mode: str = "token-mean"
    ) -> tuple[str, dict[str, float]]:
        """The old_log_prob stage on the batch at `job.input_uri`, committed by this worker: the current
        weights' log-probs and `actor/entropy` (aggregated with `entropy_agg_mode`); in bypass mode (where the
        flow runs the stage only when told to, or before the actor trains) π_old stays the rollout's
        log-probs and the forward gives the entropy. With data-parallel ranks, rank 0 commits the stage and
        returns its URI; the other ranks return ("", {})."""
        fault_point(job.root, job.stage, job.step)
        rank = self.dp.rank if self.dp is not None else 0
        if rank != 0:
            self.compute_log_prob(job.read(), True)
            return "", {}

        def compute(table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
            out = self.compute_log_prob(table, True)
            if self.bypass:
                out = B.set_column(out, "old_log_probs", out.column("rollout_log_probs"))
            t = B.to_padded(out, self.pad_token_id, columns=["entropy"])
            ent = agg_loss(t["entropy"], t["response_mask"].float(), entropy_agg_mode)
            return out, {"actor/entropy": float(ent)}

        return run_job(job, compute)

    def update_actor_from(
        self, root: str, uri: str, global_steps: int, pi_old: PiOld = "old_log_probs"
    ) -> dict[str, float]:
        """`update_actor` on the batch this worker reads from the run store at `uri` (run folder `root`)."""
        fault_point(root, "update_actor", global_steps)
        return self.update_actor(stage_files(root).read_uri(uri), global_steps, pi_old)

    # -- update ----------------------------------------------------------------------------------------------
    def update_actor(
        self, table: pa.Table, global_steps: int, pi_old: PiOld = "old_log_probs"
    ) -> dict[str, float]:
        """One PPO update over the batch (mini-batches of `ppo_mini_batch_size·n` trajectories); steps the
        lr. `pi_old`: where π_old comes from, as the flow decided (`ActorLoss.pi_old`); when the flow skipped
        the old_log_prob stage, `actor/entropy` comes from this forward."""
        if pi_old != "current" and pi_old not in table.column_names:
            raise ValueError(f"update_actor: pi_old={pi_old!r} but the batch has no {pi_old} column")
        cols = ["advantages"]
        for c in ("old_log_probs", "rollout_is_weights", "ref_log_probs", "rollout_log_probs"):
            if c in table.column_names:
                cols.append(c)
        t = B.to_padded(table, self.pad_token_id, columns=cols)
        mini = int(self.cfg.ppo_mini_batch_size) * self.n
        micro = self.cfg.ppo_micro_batch_size_per_gpu or mini
        epochs = int(self.cfg.ppo_epochs)
        calc_entropy = True  # `actor/entropy` is reported every update
        self.engine.train()
        metrics = ppo_update(
            self.engine,
            t,
            loss_fn=dataclasses.replace(self.loss, pi_old=pi_old),
            mini_batch_size=min(mini, table.num_rows),
            micro_batch_size=int(micro),
            epochs=epochs,
            shuffle=bool(self.cfg.shuffle),
            seed=self.seed + int(global_steps),
            temperature=self.temperature,
            calculate_entropy=calc_entropy,
            sum_keys=("actor/pg_loss", "actor/entropy"),
            max_token_len=int(self.cfg.ppo_max_token_len_per_gpu) if self.cfg.use_dynamic_bsz else None,
            remove_padding=self.remove_padding,
            share_prompt=self.shared_prompt,
            dp=self.dp,
        )
        self.engine.lr_step()
        return metrics

    # -- weights and checkpoints -----------------------------------------------------------------------------
    def send_weights(self, links: list[dict[str, Any]], dtype: str) -> dict[str, float]:
        """Stream the current weights, gathered one tensor at a time in `dtype`, over the push's links whose
        sender is this rank (`dapo_core.compute.weight_transport`); every rank calls it, since the gathers
        are collectives. Returns this rank's `weight_sync/*` figures."""
        from dapo_core.compute.weight_transport import Link, send_all

        rank = self.dp.rank if self.dp is not None else 0
        named = _hf_names(self.engine.iter_sync_tensors(getattr(torch, dtype)))
        return send_all(named, [Link(**d) for d in links], rank).as_metrics()

    def sync_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights one at a time under HF names, tied names left out (a model tied like this
        one shares the tensor): an in-process push (`RolloutWorker.sync_weights`)."""
        for name, t in _hf_names(self.engine.iter_sync_tensors()):
            if not isinstance(t, str):
                yield name, t

    def save_checkpoint(self, path: str) -> None:
        """Weights (HF safetensors), optimizer, scheduler and RNG states into `path`."""
        self.engine.save(path)

    def load_checkpoint(self, path: str) -> None:
        """Restore everything `save_checkpoint` wrote."""
        self.engine.load(path)

    def export_hf(self, path: str) -> None:
        """An HF folder (weights + tokenizer) loadable by transformers and vLLM."""
        self.engine.export_hf(path)

    def lr(self) -> float:
        """Current learning rate."""
        return float(self.engine.lr)


def _hf_names(
    items: Iterable[tuple[str, torch.Tensor | str]],
) -> Iterator[tuple[str, torch.Tensor | str]]:
    """Names (and alias targets) without the `module.` prefix a wrapping engine adds."""
    for name, t in items:
        yield name.removeprefix("module."), t.removeprefix("module.") if isinstance(t, str) else t


class RefWorker:
    """The frozen reference policy (only when KL is used): log-probs under the initial weights."""

    def __init__(
        self,
        model_path: str,
        *,
        pad_token_id: int,
        temperature: float,
        device: str = "cpu",
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        use_remove_padding: bool = False,
        use_shared_prompt: bool = False,
        dtype: str = "float32",
    ) -> None:
        """`max_token_len`: `ref.log_prob_max_token_len_per_gpu` when `ref.log_prob_use_dynamic_bsz`, else
        None. The reference never runs backward, so gradient checkpointing does not apply to it. `dtype`:
        `ref.dtype`, the precision its weights are loaded in. With data-parallel ranks (a process group is
        up) the model is sharded with FSDP2 and each rank computes its share of a stage."""
        self.dp = dpd.current()
        sharded = self.dp is not None and self.dp.size > 1
        self.engine = make_train_engine(
            "fsdp2" if sharded else "torch",
            model_path,
            {"lr": 0.0},
            total_steps=1,
            grad_clip=1.0,
            device=device,
            dtype=getattr(torch, dtype),
        )
        self.max_token_len = max_token_len
        self.remove_padding = bool(use_remove_padding)
        self.shared_prompt = bool(use_shared_prompt) and not sharded
        self.pad_token_id = int(pad_token_id)
        self.temperature = float(temperature)
        self.mbs = micro_batch_size

    def compute_ref_log_prob(self, table: pa.Table) -> pa.Table:
        """Add `ref_log_probs` (with data-parallel ranks: on rank 0; the others return `table` unchanged)."""
        return _with_ref_log_probs(
            self.engine,
            table,
            self.dp,
            pad_token_id=self.pad_token_id,
            temperature=self.temperature,
            micro_batch_size=self.mbs,
            max_token_len=self.max_token_len,
            remove_padding=self.remove_padding,
            share_prompt=self.shared_prompt,
        )

    def ref_log_prob_stage(self, job: StageJob) -> tuple[str, dict[str, float]]:
        """`compute_ref_log_prob` on the view at `job.input_uri`, committed by this worker (rank 0; the other
        ranks compute their share and return ("", {}))."""
        return _ref_stage(job, self.dp, self.compute_ref_log_prob)
