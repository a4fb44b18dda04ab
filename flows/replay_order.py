"""The step orders that generate ahead: `async` and `replay_buffer` (the reference's `trainer_base`).

    for each global step k:
        collect the generation launched during step k−1 (previous weights) → reward → replay buffer
        [regenerate prompts a crash left in flight]
        sample train_batch_size groups oldest-first ⟲ (evict DAPO-filtered / stale groups; refill while short)
        launch generation for step k+1 on the rollout worker — it runs WHILE the actor trains below
        split the batch into parameter_sync_step parts; for each part:
            old_log_prob → [ref] → [values] → advantage → [update_critic] → update_actor   (one local update)
        sync weights to the rollout worker (once, after all local updates)

`async`: one local update per step, groups older than `trainer.max_staleness` weight versions dropped, stale
samples corrected by the rollout IS weights. Trajectories carry their weight version (`training/off_policy/*`,
docs/ARCHITECTURE.md); `replay_train_step` has the contract of `flows.dapo_train.train_step`.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

from dapo_core.config import DapoConfig, gen_batch_size, off_policy_threshold, sync_parts
from dapo_core.stages import DynamicSamplingExhausted, exhausted_message
from flows.learn import learn
from flows.run_setup import DriverState, TrainRun
from flows.step_support import add_metrics, refill_size, step_metrics
from tasks.replay import (
    collect_generation,
    join_parts,
    launch_generation,
    pending_launches,
    regenerate_reissued,
    sample_batch,
    split_batch,
)
from tasks.rollout import sample_prompts
from tasks.update import sync_weights


def _collect(rt: TrainRun, launch_step: int, tag: str, metrics: dict) -> None:
    """Collect the generation launched as (launch_step, tag): its metrics fold into the step's, and its
    kept/seen group counts feed the run-wide keep rate (checkpointed, as in the sync order)."""
    new = collect_generation(rt, launch_step, tag)
    if "train/num_groups" in new:
        rt.keep_rate.update(int(new["train/num_kept_groups"]), int(new["train/num_groups"]))
    add_metrics(metrics, new)


def _ahead_enabled(cfg: DapoConfig) -> bool:
    return not (cfg.trainer.max_off_policy_strategy == "drop" and off_policy_threshold(cfg) < 2)


def _collect_inflight(rt: TrainRun, step: int, state: DriverState, metrics: dict) -> None:
    """Rollouts launched earlier (normally during the previous step) and prompts re-issued after a crash."""
    for launch_step, tag in pending_launches(rt):
        rt.progress.stage(f"collect rollouts of step {launch_step} ({tag})")
        _collect(rt, launch_step, tag, metrics)
    regenerate_reissued(rt, step, state.gen_step + 1)  # same gen_step (seeds) as their first launch


def weight_lag_metrics(rt: TrainRun, batch_uri: str, version: int) -> dict[str, float]:
    """How many weight versions behind the policy being trained (`version`) the batch's samples were
    generated: `training/off_policy/weight_version_lag_{max,mean}` (the async order bounds the max by
    `trainer.max_staleness`)."""
    made = rt.store.read_uri(batch_uri, columns=["weight_version"]).column("weight_version")
    lag = version - made.to_numpy(zero_copy_only=False)
    p = "training/off_policy/weight_version_lag"
    return {f"{p}_max": float(lag.max(initial=0)), f"{p}_mean": float(lag.mean()) if lag.size else 0.0}


_REFILL = re.compile(r"prompts_g\d+")
"""A refill round's prompts stage (`g0`, `g1`, ...; not `ga`, generated ahead, nor `gr<i>`, re-issued)."""


def refill_rounds(rt: TrainRun, step: int) -> int:
    """How many refill rounds step `step` committed (its `prompts_g<k>` stages)."""
    return sum(1 for stage in rt.store.committed_stages(step) if _REFILL.fullmatch(stage))


def sample_with_refill(rt: TrainRun, step: int, state: DriverState, metrics: dict) -> str:
    """Sample the step's batch from the buffer, generating with the current weights while it is short."""
    cfg = rt.cfg
    max_rounds = cfg.algorithm.filter_groups.max_num_gen_batches
    need = cfg.data.train_batch_size
    k, size = 0, 0
    while True:
        rt.progress.stage("sample replay buffer")
        batch_uri, m = sample_batch(rt, step)
        if k > 0:  # the refill batch just collected: groups the buffer can now give this step, of `need`
            have = need if batch_uri is not None else int(m.get("training/replay/sampleable_groups", 0))
            rt.progress.gen_batch(k - 1, size, min(have, need), need)
        if batch_uri is not None:
            # a replayed batch (committed before a crash or a restart) comes back at once: the refill rounds
            # that made it count all the same, so the generation seeds (gen_step) go on as they did
            rounds = max(k, refill_rounds(rt, step))
            state.gen_step += rounds - k
            metrics.update(m)
            metrics["train/num_gen_batches"] = float(rounds)
            return batch_uri
        if m.get("must_wait"):
            _collect_inflight(rt, step, state, metrics)
        if max_rounds > 0 and k >= max_rounds:
            sampleable = int(m.get("training/replay/sampleable_groups", 0))
            raise DynamicSamplingExhausted(
                exhausted_message(k, max_rounds, sampleable, cfg.data.train_batch_size)
            )
        deficit = int(m.get("refill_needed", 0))
        size = max(refill_size(cfg, rt.keep_rate, deficit, fixed=deficit), 1)
        tag = f"g{k}"
        rt.progress.stage(f"refill {tag} ({size} prompts)")
        prompts_uri, _ = sample_prompts(rt, step, tag, size, replay=True)
        state.gen_step += 1
        launch_generation(rt, step, tag, state.gen_step, prompts_uri)
        _collect(rt, step, tag, metrics)
        k += 1


def replay_train_step(rt: TrainRun, step: int, state: DriverState) -> dict:
    """One global step of the replay-buffer order; returns its metrics (contract of
    `dapo_train.train_step`)."""
    cfg = rt.cfg
    t0 = time.perf_counter()
    metrics: dict = {}
    _collect_inflight(rt, step, state, metrics)
    batch_uri = sample_with_refill(rt, step, state, metrics)
    metrics.update(weight_lag_metrics(rt, batch_uri, state.weight_version))

    # Generation for the next step runs on the rollout worker with the current (previous) weights, during the
    # update.
    if step < state.total_steps and _ahead_enabled(cfg):
        remaining = int(metrics.get("training/replay/sampleable_groups", 0))
        size = refill_size(
            cfg, rt.keep_rate, cfg.data.train_batch_size - remaining, fixed=gen_batch_size(cfg)
        )
        if size > 0:
            rt.progress.stage(f"launch rollouts for step {step + 1} ({size} prompts)")
            prompts_uri, _ = sample_prompts(rt, step, "ga", size, replay=True)
            state.gen_step += 1
            launch_generation(rt, step, "ga", state.gen_step, prompts_uri)

    parts = sync_parts(cfg)
    per_part: dict[str, list[float]] = defaultdict(list)
    adv_uris = []
    for i, uri in enumerate(split_batch(rt, step, batch_uri, parts)):
        adv_uri, stage_metrics = learn(rt, step, uri, part=i, label=f"local update {i + 1}/{parts}: ")
        adv_uris.append(adv_uri)
        for m in stage_metrics:
            for key, v in m.items():
                per_part[key].append(v)
    for (
        key,
        vals,
    ) in per_part.items():  # times add up over the parts, the last lr holds, other metrics average
        if key.startswith("timing_s/"):
            metrics[key] = sum(vals)
        else:
            metrics[key] = vals[-1] if key.endswith("lr") else sum(vals) / len(vals)
    updated = step > cfg.trainer.critic_warmup
    metrics["training/local_updates"] = float(parts if updated else 0)

    save_freq = cfg.trainer.save_freq
    if save_freq > 0 and (step % save_freq == 0 or step == state.total_steps):
        # This step ends with a checkpoint: nothing may stay in flight across it, or a run resumed from it
        # would regenerate those prompts with newer weights than the uninterrupted run used (not bitwise
        # equal).
        for launch_step, tag in pending_launches(rt):
            rt.progress.stage(f"collect rollouts of step {launch_step} ({tag}) before the checkpoint")
            _collect(rt, launch_step, tag, metrics)
    if updated:
        rt.progress.stage("sync weights")
        state.weight_version += 1
        metrics.update(sync_weights(rt, step, state.weight_version))
    adv_uri = join_parts(rt, step, adv_uris)
    metrics["timing_s/step"] = time.perf_counter() - t0
    metrics.update(step_metrics(rt, step, adv_uri, metrics))
    return metrics
