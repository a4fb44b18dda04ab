"""Learning from one batch, the part both step orders share:

    old_log_prob → [ref] → [values] → advantage → [update_critic] → [update_actor after critic_warmup]

The sync order (`flows.dapo_train.train_step`) runs it once per step on the whole batch; the replay-buffer
order (`flows.replay_order.replay_train_step`) runs it once per local update on each part of the batch
(`part=i`, so the stages commit as `<name>_p<i>`). Pushing the new weights to the rollout worker is the step
order's own stage (`tasks.update.sync_weights`), once per step in both orders.

On-policy skip: `pi_old_source` is the one place that decides where the update's π_old comes from. When the
update is exactly on-policy (`old_log_prob_needed` returns None: one PPO epoch over one mini-batch, nothing
else reading π_old) the old_log_prob forward is skipped and the update is told `pi_old="current"`: π_old is
its own forward's log-probs, detached, so the ratio is exactly 1, as it is (to float precision) after a
separate forward with the same weights; the step logs `timing_s/old_log_prob = 0` and
`actor/old_log_prob_skipped = 1`. `actor_rollout_ref.actor.skip_old_log_prob_when_on_policy=false` always
runs the stage.

Bypass mode (`algorithm.rollout_correction.bypass_mode`): π_old is the rollout's own log-probs, already in the
batch, so the stage is skipped whatever the epochs and mini-batches (`pi_old="rollout_log_probs"`); the
update computes the IS / RS correction against π_θ per micro-batch (one forward per sample in all).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from dapo_core.algo.losses import PiOld
from dapo_core.config import DapoConfig, need_reference_policy, sync_parts, use_critic
from flows.run_inputs import default_model_path
from flows.run_setup import TrainRun
from tasks.compute import advantage, old_log_prob, ref, values
from tasks.stage_commit import StageResult
from tasks.update import update_actor, update_critic


def _model_dropout(model_path: str) -> float:
    """The largest `*dropout*` probability in the model folder's config.json (0 when there is none)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return 0.0
    conf = json.loads(path.read_text())
    probs = [v for k, v in conf.items() if "dropout" in k and isinstance(v, int | float)]
    return float(max(probs, default=0.0))


def old_log_prob_needed(cfg: DapoConfig, parts: int = 1, model_path: str | None = None) -> str | None:
    """Why the batch needs a separate π_old forward (the first reason, as the config key to change), or None
    when the update is exactly on-policy and the old_log_prob stage can be skipped.

    `parts`: local updates per batch (the replay order's `parameter_sync_step`; 1 in the sync order). Exactly
    on-policy means: one PPO epoch over one mini-batch (`ppo_mini_batch_size · parts ≥ train_batch_size`), so
    the weights that would compute π_old are the ones the update starts from; no dropout in the model (a
    train-mode forward would differ from the eval-mode π_old forward); and nothing else reads π_old: no
    rollout correction (IS / RS / bypass mode), no KL in the reward, no `bypass_mode` policy loss. In bypass
    mode π_old is the rollout's log-probs, so no forward is needed either (None).
    """
    actor = cfg.actor_rollout_ref.actor
    rc = cfg.algorithm.rollout_correction
    if not actor.skip_old_log_prob_when_on_policy:
        return "actor_rollout_ref.actor.skip_old_log_prob_when_on_policy=false"
    if rc.bypass_mode:
        return None
    if actor.ppo_epochs != 1:
        return f"actor_rollout_ref.actor.ppo_epochs={actor.ppo_epochs} (more than one pass)"
    if actor.ppo_mini_batch_size * parts < cfg.data.train_batch_size:
        return (
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} < "
            f"data.train_batch_size={cfg.data.train_batch_size}"
            + (f" / parameter_sync_step={parts}" if parts > 1 else "")
            + " (more than one optimizer step per batch)"
        )
    if rc.rollout_is is not None or rc.rollout_rs is not None:
        return "algorithm.rollout_correction (IS/RS weights read π_old)"
    if cfg.algorithm.use_kl_in_reward:
        return "algorithm.use_kl_in_reward=true (the KL penalty reads π_old)"
    if (actor.policy_loss.loss_mode or "vanilla") == "bypass_mode":
        return "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"
    dropout = _model_dropout(model_path or default_model_path(cfg))
    if dropout > 0:
        return f"the model's dropout {dropout} > 0 (a train-mode forward is not the π_old forward)"
    return None


def pi_old_source(cfg: DapoConfig, step: int, parts: int = 1, model_path: str | None = None) -> PiOld:
    """Where step `step`'s update takes π_old from: the old_log_prob stage's column when the batch needs a
    separate forward (`old_log_prob_needed`) or the actor does not train yet (`trainer.critic_warmup`: the
    stage then runs for its metrics); else the rollout's log-probs in bypass mode, or the update's own
    forward (`"current"`, exactly on-policy)."""
    if old_log_prob_needed(cfg, parts, model_path) or step <= cfg.trainer.critic_warmup:
        return "old_log_probs"
    return "rollout_log_probs" if cfg.algorithm.rollout_correction.bypass_mode else "current"


def learn(
    rt: TrainRun,
    step: int,
    batch_uri: str,
    part: int | None = None,
    label: str = "",
) -> tuple[str, list[dict[str, float]]]:
    """Run the stages on the batch at `batch_uri`; returns the advantage table's URI and each stage's metrics,
    in stage order. `label` prefixes the stage names in the progress display."""
    metrics: list[dict[str, float]] = []

    def stage(task: Callable[..., StageResult], uri: str, **kwargs: object) -> str:
        rt.progress.stage(label + task.__name__)
        out, m = task(rt, step, uri, part=part, **kwargs)
        metrics.append(m)
        return out

    rt.rollout.release()  # colocated GPUs: the training ranks get the engine's memory
    parts = sync_parts(rt.cfg) if part is not None else 1
    pi_old = pi_old_source(rt.cfg, step, parts)
    if not rt.announced:
        rt.announced = True
        reason = old_log_prob_needed(rt.cfg, parts)
        if reason:
            print(f"old_log_prob: separate forward ({reason})")
        elif rt.cfg.algorithm.rollout_correction.bypass_mode:
            print("old_log_prob: skipped, bypass mode: π_old = the rollout's log-probs")
        else:
            print(
                "old_log_prob: skipped, the update is exactly on-policy (one epoch, one mini-batch): "
                "π_old = the current policy, ratio 1"
            )
    if pi_old == "old_log_probs":
        uri = stage(old_log_prob, batch_uri)
    else:
        uri = batch_uri
        metrics.append({"timing_s/old_log_prob": 0.0, "actor/old_log_prob_skipped": 1.0})
    if need_reference_policy(rt.cfg):
        uri = stage(ref, uri)
    if use_critic(rt.cfg):
        uri = stage(values, uri)
    uri = stage(advantage, uri)
    if use_critic(rt.cfg):
        stage(update_critic, uri)
    if step > rt.cfg.trainer.critic_warmup:
        stage(update_actor, uri, pi_old=pi_old)
    return uri, metrics
