"""Learning from one batch, the part both step orders share:

    old_log_prob → [ref] → [values] → advantage → [update_critic] → [update_actor after critic_warmup]

The sync order (`flows.dapo_train.train_step`) runs it once per step on the whole batch; the replay-buffer
order (`flows.replay_order.replay_train_step`) runs it once per local update on each part of the batch
(`part=i`, so the stages commit as `<name>_p<i>`). Pushing the new weights to the rollout worker is left to
the step order.
"""

from __future__ import annotations

from collections.abc import Callable

from dapo_core.config import need_reference_policy, use_critic
from flows.run_setup import TrainRun
from tasks.common import StageResult
from tasks.compute import advantage, old_log_prob, ref, values
from tasks.update import update_actor, update_critic


def learn(
    rt: TrainRun, step: int, batch_uri: str, part: int | None = None, label: str = ""
) -> tuple[str, list[dict[str, float]]]:
    """Run the stages on the batch at `batch_uri`; returns the advantage table's URI and each stage's metrics,
    in stage order. `label` prefixes the stage names in the progress display."""
    metrics: list[dict[str, float]] = []

    def stage(task: Callable[..., StageResult], uri: str) -> str:
        rt.progress.stage(label + task.__name__)
        out, m = task(rt.run_id, step, uri, part=part)
        metrics.append(m)
        return out

    uri = stage(old_log_prob, batch_uri)
    if need_reference_policy(rt.cfg):
        uri = stage(ref, uri)
    if use_critic(rt.cfg):
        uri = stage(values, uri)
    uri = stage(advantage, uri)
    if use_critic(rt.cfg):
        stage(update_critic, uri)
    if step > rt.cfg.trainer.critic_warmup:
        stage(update_actor, uri)
    return uri, metrics
