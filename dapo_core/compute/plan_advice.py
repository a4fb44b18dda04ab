"""The advice of `dapo plan`: config changes that make a failing check fit, found by re-planning with each.

A candidate is a set of dotted overrides (what a user appends to `dapo train`). It is offered only if, applied
to the config, the failing check passes and no check that passed starts failing. Candidates with a number
(a token budget, a utilisation, a degree) take the value closest to the current one that fits. When no single
candidate fits, the changes that do not raise the check are applied together and offered as one
combined change if that fits (then trimmed: a change not needed is dropped, a number moved back towards the
current value); otherwise nothing is offered.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

__all__ = ["FSDP_STRATEGIES", "apply_overrides", "candidates", "search"]

A = "actor_rollout_ref."
FSDP_STRATEGIES = ("fsdp", "fsdp2")
"""Actor strategies that shard over the whole cluster (verl's FSDP engine names)."""


def _get(cfg: Any, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        if not hasattr(obj, part):
            raise AttributeError(key)
        obj = getattr(obj, part)
    return obj


def _has(cfg: Any, key: str) -> bool:
    try:
        _get(cfg, key)
    except AttributeError:
        return False
    return True


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """A deep copy of the typed config `cfg` with `key=value` overrides set (values parsed as YAML)."""
    import yaml  # type: ignore[import-untyped, unused-ignore]

    new = copy.deepcopy(cfg)
    for item in overrides:
        key, _, text = item.partition("=")
        *path, last = key.split(".")
        obj = new
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, yaml.safe_load(text))
    return new


def _lower(budget: int, floor: int) -> list[int]:
    """Token budgets below `budget`, halving, down to `floor` (the per-GPU share of one full-length row: a
    smaller budget changes nothing, the row goes alone)."""
    out = [budget // 2**k for k in range(1, 8) if budget // 2**k > floor]
    return [*out, floor] if floor < budget else []


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def candidates(cfg: Any, check: str, heads: int) -> list[list[list[str]]]:
    """Per candidate, the override sets to try in order (closest to the current config first); `heads` (the
    model's attention heads) bounds the rollout's tensor-parallel degree."""
    from dapo_core.compute.engines.train import TRAIN_ENGINES

    arr = cfg.actor_rollout_ref
    actor, ro = arr.actor, arr.rollout
    out: list[list[list[str]]] = []
    floor = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)

    def flag(key: str, value: Any = True) -> None:
        if _has(cfg, key) and _get(cfg, key) != value:
            out.append([[f"{key}={_fmt(value)}"]])

    def numbers(key: str, values: list[Any], extra: list[str] | None = None) -> None:
        if _has(cfg, key):
            cur = _get(cfg, key)
            opts = [[*(extra or []), f"{key}={_fmt(v)}"] for v in values if v != cur]
            if opts:
                out.append(opts)

    training = check in ("actor", "GPU shared by all roles") or check.startswith("host")
    if training:
        flag(A + "model.enable_gradient_checkpointing")
        flag(A + "model.use_remove_padding")
        budget = int(actor.ppo_max_token_len_per_gpu)
        dyn = [] if actor.use_dynamic_bsz else [f"{A}actor.use_dynamic_bsz=true"]
        numbers(
            A + "actor.ppo_max_token_len_per_gpu",
            _lower(budget, floor),
            dyn,
        )
        mbs = actor.ppo_micro_batch_size_per_gpu
        if not actor.use_dynamic_bsz and mbs and mbs > 1:
            numbers(
                A + "actor.ppo_micro_batch_size_per_gpu",
                [mbs // 2**k for k in range(1, 8) if mbs // 2**k >= 1],
            )
        lbud = int(ro.log_prob_max_token_len_per_gpu)
        ldyn = [] if ro.log_prob_use_dynamic_bsz else [f"{A}rollout.log_prob_use_dynamic_bsz=true"]
        numbers(
            A + "rollout.log_prob_max_token_len_per_gpu",
            _lower(lbud, floor),
            ldyn,
        )
        if actor.strategy == "deepspeed":
            d = A + "actor.deepspeed."
            flag(d + "bf16")
            flag(d + "offload_optimizer")
            if int(actor.deepspeed.zero_stage) < 3:
                out.append([[f"{d}zero_stage=3"]])
            if not actor.deepspeed.offload_param:
                out.append([[f"{d}zero_stage=3", f"{d}offload_param=true"]])
        if actor.strategy in FSDP_STRATEGIES:
            nn = int(cfg.trainer.nnodes)
            numbers("trainer.nnodes", [nn * 2, nn * 4, nn * 8])
        for strategy in ("fsdp2", "deepspeed"):  # both build LoRA adapters too
            if strategy != actor.strategy and strategy in TRAIN_ENGINES and str(cfg.trainer.device) != "cpu":
                extra = [f"{A}actor.deepspeed.bf16=true"] if strategy == "deepspeed" else []
                out.append([[f"{A}actor.strategy={strategy}", *extra]])
    if check in ("ref", "GPU shared by all roles") or check.startswith("host"):
        flag(A + "ref.dtype", "bfloat16")
        rb = int(arr.ref.log_prob_max_token_len_per_gpu)
        rdyn = [] if arr.ref.log_prob_use_dynamic_bsz else [f"{A}ref.log_prob_use_dynamic_bsz=true"]
        numbers(
            A + "ref.log_prob_max_token_len_per_gpu",
            _lower(rb, floor),
            rdyn,
        )
        flag(A + "model.use_remove_padding")
    if check == "critic":
        flag("critic.model.enable_gradient_checkpointing")
        flag("critic.model.use_remove_padding")
        cb = int(cfg.critic.ppo_max_token_len_per_gpu)
        numbers(
            "critic.ppo_max_token_len_per_gpu",
            _lower(cb, floor),
            ["critic.use_dynamic_bsz=true"],
        )
    if check in ("rollout", "GPU shared by all roles") or check.startswith("host"):
        if ro.name == "vllm":
            util = float(ro.gpu_memory_utilization)
            if check == "rollout":
                numbers(
                    A + "rollout.gpu_memory_utilization",
                    [u for u in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95) if u > util],
                )
            else:
                numbers(
                    A + "rollout.gpu_memory_utilization",
                    [u for u in (0.7, 0.6, 0.5, 0.4, 0.3, 0.2) if u < util],
                )
                flag(A + "rollout.free_cache_engine")
            tp, per = int(ro.tensor_model_parallel_size), int(cfg.trainer.n_gpus_per_node)
            numbers(
                A + "rollout.tensor_model_parallel_size",
                [k for k in (2, 4, 8) if tp < k <= per and heads % k == 0],
            )
        else:
            seqs = int(ro.max_num_seqs)
            numbers(A + "rollout.max_num_seqs", [seqs // 2**k for k in range(1, 10) if seqs // 2**k >= 1])
            flag(A + "rollout.dtype", "bfloat16")
    return out


def search(cfg: Any, check: str, plan_of: Callable[[Any], Any]) -> list[str]:
    """The changes (each a space-separated list of overrides) that make `check` fit without breaking a check
    that fits now, closest first; `plan_of` makes the plan of a config. A single combined change when no
    candidate fits alone; [] when none does."""
    base = plan_of(cfg)
    before = {r.role: r.fits() for r in base.checks()}

    def judge(overrides: list[str]) -> tuple[bool, int | None]:
        try:
            p = plan_of(apply_overrides(cfg, overrides))
        except (AttributeError, ValueError):  # PlanError is a ValueError
            return False, None
        now = {r.role: r for r in p.checks()}
        target = next((r for r in p.checks() if r.role == check), None)
        if target is None:
            return False, None
        broken = any(before.get(k) is not False and v.fits() is False for k, v in now.items())
        return target.fits() is True and not broken, target.total

    current = next(r.total for r in base.checks() if r.role == check)
    fixes: list[str] = []
    helping: list[list[list[str]]] = []  # candidates that do not raise the check, each with its options
    for options in candidates(cfg, check, base.shape.num_attention_heads):
        for overrides in options:
            if judge(overrides)[0]:
                fixes.append(" ".join(overrides))
                break
        else:
            total = judge(options[-1])[1]
            switch = any(o.startswith(f"{A}actor.strategy=") for o in options[-1])
            if total is not None and total <= current and not switch:  # another engine: not combinable
                helping.append(options)
    if fixes or not helping:
        return fixes
    # No single change fits: take every helping change at its strongest, then drop what is not needed and
    # relax each number back towards the current value while the whole still fits.
    chosen = [options[-1] for options in helping]
    if not judge(_merge(chosen))[0]:
        return []
    for i in range(len(chosen)):
        trial = [*chosen[:i], [], *chosen[i + 1 :]]
        if judge(_merge(trial))[0]:
            chosen = trial
            continue
        for overrides in helping[i]:  # closest to the current config first
            trial = [*chosen[:i], overrides, *chosen[i + 1 :]]
            if judge(_merge(trial))[0]:
                chosen = trial
                break
    return [" ".join(_merge(chosen))]


def _merge(groups: list[list[str]]) -> list[str]:
    """The overrides of several changes in order, a later value of a key replacing an earlier one."""
    out: dict[str, str] = {}
    for group in groups:
        for item in group:
            out[item.split("=", 1)[0]] = item
    return list(out.values())
