"""The replay-buffer step order (`trainer.step_order=replay_buffer`; the reference's `trainer_base` separate-async).

Rollouts run one step ahead of training and land in a replay buffer over the run store:

    for each global step k:
        collect the generation launched during step k−1 (previous weights) → reward → replay buffer
        [regenerate prompts a crash left in flight]
        sample train_batch_size groups oldest-first ⟲ (evict DAPO-filtered / stale groups; refill while short)
        launch generation for step k+1 on the rollout worker — it runs WHILE the actor trains below
        split the batch into parameter_sync_step parts; for each part:
            old_log_prob → [ref] → [values] → advantage → [update_critic] → update_actor   (one local update)
        sync weights to the rollout worker (once, after all local updates)

Every trajectory is stamped with the weight version that generated it; `training/off_policy/*`
(docs/REFERENCE.md §7.7) measures the staleness of each sampled batch: a batch generated during step k−1 and
trained at step k has `trajectory_staleness = (k − 1) − weight_version = 1`. Generation ahead is skipped when
it could never be used (`max_off_policy_strategy=drop` with `max_off_policy_threshold < 2`: its span at use
would be 2) and at the last step.

`replay_train_step` has the contract of `flows.dapo_train.train_step`: it advances `state.gen_step` (one per
generation batch) and `state.weight_version` (one per global step, after the sync) and returns the step's metrics.
In-process workers (`trainer.use_ray=false`) run the same order but generate at submission, so nothing overlaps.
"""

from __future__ import annotations

import time
from collections import defaultdict

from dapo_core.algo.dynamic_sampling import KeepRateEstimator, next_gen_batch_size
from dapo_core.config import gen_batch_size, need_reference_policy, use_critic
from dapo_core.stages import DynamicSamplingExhausted, exhausted_message
from flows.run_setup import DriverState, step_metrics
from tasks import runtime
from tasks.compute import advantage, old_log_prob, ref, values
from tasks.replay import (
    collect_generation,
    draw_prompts,
    join_parts,
    launch_generation,
    pending_launches,
    regenerate_reissued,
    sample_batch,
    split_batch,
)
from tasks.update import sync_weights, update_actor, update_critic


def _keep_rate(run_id: str) -> KeepRateEstimator:
    # the run-wide estimator that DriverState checkpoints and `restore` reloads (as the sync order uses)
    return runtime.get(run_id).extras.setdefault("keep_rate", KeepRateEstimator())


def _add(metrics: dict, new: dict, run_id: str) -> None:
    """Fold a generation's metrics into the step's (times and token counts add up) and feed the keep rate."""
    if "train/num_groups" in new:
        _keep_rate(run_id).update(int(new["train/num_kept_groups"]), int(new["train/num_groups"]))
    for key, v in new.items():
        summed = key.startswith(("timing_s/", "perf/")) or key == "train/added_groups"
        metrics[key] = metrics.get(key, 0.0) + v if summed else v


def _refill_size(cfg, run_id: str, deficit: int, *, ahead: bool) -> int:
    """Prompts to generate for `deficit` missing groups: fixed (`gen_batch_size` ahead, the deficit when short)
    or adaptive to the observed keep rate (`algorithm.filter_groups.refill=adaptive`)."""
    fg = cfg.algorithm.filter_groups
    base = gen_batch_size(cfg)
    if deficit <= 0:
        return 0
    if fg.enable and str(fg.refill) == "adaptive":
        return next_gen_batch_size(int(deficit), _keep_rate(run_id).rate, base=base)
    return base if ahead else int(deficit)


def _ahead_enabled(cfg) -> bool:
    tr = cfg.trainer
    return not (str(tr.max_off_policy_strategy) == "drop" and int(tr.max_off_policy_threshold) < 2)


def _collect_inflight(run_id: str, step: int, state: DriverState, metrics: dict, progress) -> None:
    """Rollouts launched earlier (normally during the previous step) and prompts re-issued after a crash."""
    for launch_step, tag in pending_launches(run_id):
        progress.stage(f"collect rollouts of step {launch_step} ({tag})")
        _add(metrics, collect_generation(run_id, launch_step, tag), run_id)
    regenerate_reissued(run_id, step, state.gen_step + 1)  # same gen_step (seeds) as their first launch


def sample_with_refill(run_id: str, cfg, step: int, state: DriverState, metrics: dict, progress) -> str:
    """Sample the step's batch from the buffer, generating synchronously (current weights) while it is short."""
    max_rounds = int(cfg.algorithm.filter_groups.max_num_gen_batches)
    k = 0
    while True:
        progress.stage("sample replay buffer")
        batch_uri, m = sample_batch(run_id, step)
        if batch_uri is not None:
            metrics.update(m)
            metrics["train/num_gen_batches"] = float(k)
            return batch_uri
        if m.get("must_wait"):
            _collect_inflight(run_id, step, state, metrics, progress)
        if max_rounds > 0 and k >= max_rounds:
            raise DynamicSamplingExhausted(
                exhausted_message(
                    k,
                    max_rounds,
                    int(m.get("training/replay/sampleable_groups", 0)),
                    int(cfg.data.train_batch_size),
                )
            )
        size = max(_refill_size(cfg, run_id, int(m.get("refill_needed", 0)), ahead=False), 1)
        tag = f"g{k}"
        progress.stage(f"refill {tag} ({size} prompts)")
        prompts_uri, _ = draw_prompts(run_id, step, tag, size)
        state.gen_step += 1
        launch_generation(run_id, step, tag, state.gen_step, prompts_uri)
        _add(metrics, collect_generation(run_id, step, tag), run_id)
        k += 1


def replay_train_step(run_id: str, cfg, step: int, state: DriverState, progress) -> dict:
    """One global step of the replay-buffer order; returns its metrics (contract of `dapo_train.train_step`)."""
    t0 = time.perf_counter()
    metrics: dict = {}
    _collect_inflight(run_id, step, state, metrics, progress)
    batch_uri = sample_with_refill(run_id, cfg, step, state, metrics, progress)

    # Generation for the next step runs on the rollout worker with the current (previous) weights, during the update.
    if step < state.total_steps and _ahead_enabled(cfg):
        remaining = int(metrics.get("training/replay/sampleable_groups", 0))
        size = _refill_size(cfg, run_id, int(cfg.data.train_batch_size) - remaining, ahead=True)
        if size > 0:
            progress.stage(f"launch rollouts for step {step + 1} ({size} prompts)")
            prompts_uri, _ = draw_prompts(run_id, step, "ga", size)
            state.gen_step += 1
            launch_generation(run_id, step, "ga", state.gen_step, prompts_uri)

    parts = int(cfg.trainer.parameter_sync_step)
    per_part: dict[str, list[float]] = defaultdict(list)
    adv_uris = []
    for i, uri in enumerate(split_batch(run_id, step, batch_uri, parts)):
        progress.stage(f"local update {i + 1}/{parts}")
        stages = [old_log_prob]
        if need_reference_policy(cfg):
            stages.append(ref)
        if use_critic(cfg):
            stages.append(values)
        stages.append(advantage)
        for stage in stages:
            uri, m = stage(run_id, step, uri, part=i)
            for key, v in m.items():
                per_part[key].append(v)
        adv_uris.append(uri)
        if use_critic(cfg):
            for key, v in update_critic(run_id, step, uri, part=i)[1].items():
                per_part[key].append(v)
        if step > int(cfg.trainer.critic_warmup):
            for key, v in update_actor(run_id, step, uri, part=i)[1].items():
                per_part[key].append(v)
    for (
        key,
        vals,
    ) in per_part.items():  # times add up over the parts, the last lr holds, other metrics average
        metrics[key] = (
            sum(vals)
            if key.startswith("timing_s/")
            else vals[-1]
            if key.endswith("lr")
            else sum(vals) / len(vals)
        )
    metrics["training/local_updates"] = float(parts if step > int(cfg.trainer.critic_warmup) else 0)

    save_freq = int(cfg.trainer.save_freq)
    if save_freq > 0 and (step % save_freq == 0 or step == state.total_steps):
        # This step ends with a checkpoint: nothing may stay in flight across it, or a run resumed from it would
        # regenerate those prompts with newer weights than the uninterrupted run used (not bitwise equal).
        for launch_step, tag in pending_launches(run_id):
            progress.stage(f"collect rollouts of step {launch_step} ({tag}) before the checkpoint")
            _add(metrics, collect_generation(run_id, launch_step, tag), run_id)
    if step > int(cfg.trainer.critic_warmup):
        progress.stage("sync weights")
        state.weight_version += 1
        sync_weights(run_id, step, state.weight_version)
    adv_uri = join_parts(run_id, step, adv_uris)
    metrics["timing_s/step"] = time.perf_counter() - t0
    metrics.update(step_metrics(run_id, step, adv_uri, metrics))
    return metrics
