"""Cross-field checks of a loaded config (the typed `DapoConfig`): closed sets of values, positive integers,
batch arithmetic, loss, KL, rollout correction, overlong shaping, sampling, step order, optimizers and the
tiny model.

`_collect_problems` returns (errors, warnings) as 'key: problem — fix' lines;
`dapo_core.config.loading.validate_config` turns them into one `ConfigError` and `ConfigWarning`s. A field
typed by a closed set (`dapo_core.config.choices`) is checked against that set by `_closed_set_problems`,
which reads the schema's annotations: a new field of such a type is checked without an entry here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal

from dapo_core.algo.advantages import ADV_ESTIMATOR_REGISTRY
from dapo_core.algo.kl import KL_KINDS
from dapo_core.algo.losses import POLICY_LOSS_REGISTRY
from dapo_core.algo.rollout_correction.config import (
    SUPPORTED_LOSS_TYPES,
    SUPPORTED_ROLLOUT_IS_LEVELS,
    RolloutCorrection,
    parse_is_threshold,
    parse_rs_option_names,
    parse_rs_options,
)
from dapo_core.config.choices import LITERALS, allowed
from dapo_core.config.schema import (
    DapoConfig,
    EvalConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
    ValKwargsConfig,
)
from dapo_core.config.unused import NO_OPS, default_value, not_implemented_problems

# The option lists are defined once: the closed sets in dapo_core.config.choices (those of loss_agg_mode and
# rollout correction are the algo layer's, which implements them), the open ones in dapo_core.algo:
# adv_estimator -> ADV_ESTIMATOR_REGISTRY, KL estimators -> KL_KINDS, policy losses -> POLICY_LOSS_REGISTRY,
# rollout correction's other keys -> the parsers of dapo_core.algo.rollout_correction.config.

GROUP_ESTIMATORS = (
    "grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
    "reinforce_plus_plus_baseline",
)  # fmt: skip
"""Estimators whose baseline comes from the other samples of a group (need rollout.n >= 2)."""

TRAIN_DTYPES: tuple[str, ...] = allowed("TrainDtype")
"""Values of the actor's `fsdp_config.mixed_precision` dtypes (ours and verl's spelling)."""


def train_dtype(name: str) -> str:
    """The torch name of a `TRAIN_DTYPES` value: fp32 -> float32, bf16 -> bfloat16."""
    return {"fp32": "float32", "bf16": "bfloat16"}.get(name, name)


FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""Dynamic-sampling metrics that always exist (others must be reward extra-info names)."""

_HINTS: dict[str, str] = {
    "actor_rollout_ref.rollout.name": "use hf on CPU, vllm on GPUs",
    "algorithm.filter_groups.refill": "fixed matches the reference",
    "actor_rollout_ref.rollout.dtype": "auto: the engine's default",
    "actor_rollout_ref.rollout.weight_transport": (
        "auto: same_device where each actor rank shares a device with one replica"
    ),
}
"""The fix added to a closed-set key's 'is not one of' line (key -> hint)."""

_OWN_MESSAGE = (
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.deepspeed.zero_stage",
    "algorithm.rollout_correction.rollout_is",
    "data.synthetic.kind",
)
"""Closed-set keys whose check below says more than 'is not one of' (list fields have their own too)."""


@functools.cache
def _closed_set_fields() -> tuple[tuple[str, tuple[Any, ...], bool], ...]:
    """(dotted key, allowed values, whether a list of them) of every schema field typed by a closed set of
    `dapo_core.config.choices` (alone, optional or as a list's items), in schema order."""
    out: list[tuple[str, tuple[Any, ...], bool]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls, localns=LITERALS)
        for f in dataclasses.fields(cls):
            t, key = hints[f.name], prefix + f.name
            if isinstance(t, type) and dataclasses.is_dataclass(t):
                walk(t, key + ".")
                continue
            is_list = typing.get_origin(t) is list
            if is_list:
                (t,) = typing.get_args(t)
            union = typing.get_origin(t) in (typing.Union, types.UnionType)
            sets = [a for a in (typing.get_args(t) if union else (t,)) if typing.get_origin(a) is Literal]
            if sets:
                out.append((key, typing.get_args(sets[0]), is_list))

    walk(DapoConfig, "")
    return tuple(out)


def _closed_set_problems(c: DapoConfig) -> list[str]:
    """'key: value is not one of [...]' for every single-valued closed-set field outside its set (null passes
    where the field is optional; the keys of `_OWN_MESSAGE` and list fields are checked with their own
    messages)."""
    errs = []
    for key, values, is_list in _closed_set_fields():
        v = _get(c, key)
        if is_list or key in _OWN_MESSAGE or v is None or v in values:
            continue
        hint = _HINTS.get(key)
        errs.append(f"{key}: {v!r} is not one of {list(values)}" + (f" — {hint}" if hint else "") + ".")
    return errs


_POSITIVE_INTS = (
    "data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
    "data.synthetic.num_train", "data.synthetic.num_val", "data.synthetic.num_operands",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
    "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.model.sft.batch_size", "trainer.parameter_sync_step",
    "trainer.max_off_policy_threshold", "trainer.total_epochs", "reward_model.num_workers",
    "eval.n", "actor_rollout_ref.model.tiny.hidden_size", "actor_rollout_ref.model.tiny.num_hidden_layers",
    "actor_rollout_ref.model.tiny.num_attention_heads", "actor_rollout_ref.model.tiny.num_key_value_heads",
    "actor_rollout_ref.model.tiny.head_dim", "actor_rollout_ref.model.tiny.intermediate_size",
    "actor_rollout_ref.model.tiny.max_position_embeddings",
)  # fmt: skip
"""Integer keys that must be >= 1."""

_OPTIONAL_POSITIVE_INTS = (
    "data.gen_batch_size", "data.val_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_mini_batch_size",
    "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs", "trainer.total_training_steps",
    "trainer.max_actor_ckpt_to_keep",
)  # fmt: skip
"""Integer keys that are null or >= 1."""


_POSITIVE_FLOATS: dict[str, str] = {
    "reward_model.timeout_s": "the seconds one scoring call may take (0 would fail every reward); e.g. 10",
    "trainer.restart_window_s": "the seconds over which trainer.max_restarts counts restarts; e.g. 3600",
    "trainer.restart_wait_s": "the seconds a restart waits for its new workers to start; e.g. 600",
}
"""Duration/size keys that must be a finite number > 0 (key -> what it is, with a typical value)."""

_UNIT_INTERVAL: dict[str, tuple[bool, str]] = {
    "reward_model.max_failure_rate": (True, "0.5 stops a step when over half of its rewards fail"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (False, "the share of GPU memory vLLM may take"),
    "algorithm.filter_groups.surplus_budget": (True, "0.005: half a percent of train_batch_size per batch"),
}
"""Keys in [0, 1] (key -> (0 allowed, what it means))."""


def _get(c: Any, key: str) -> Any:
    """Value at a dotted key of the typed config (or of one of its sections)."""
    for part in key.split("."):
        c = getattr(c, part)
    return c


def _problem(parse: Any, *args: Any) -> str | None:
    """The message of the error `parse(*args)` raises (one of the algo layer's parsers), or None if fine."""
    try:
        parse(*args)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _async_problems(c: DapoConfig) -> list[str]:
    """The async order's settings: a staleness bound >= 0, the replay-buffer order's own keys at their
    defaults (the async order sets them), and a correction for the stale samples."""
    tr, rc = c.trainer, c.algorithm.rollout_correction
    errs = []
    if not isinstance(tr.max_staleness, int) or tr.max_staleness < 0:
        errs.append(
            f"trainer.max_staleness: {tr.max_staleness!r} must be a whole number >= 0 (DAPO async: 1)."
        )
    for key, default in (
        ("parameter_sync_step", 1),
        ("max_off_policy_threshold", 8),
        ("max_off_policy_strategy", "drop"),
    ):
        value = getattr(tr, key)
        if value != default:
            errs.append(
                f"trainer.{key}: {value!r} is the replay_buffer order's setting; step_order=async syncs "
                f"the weights after every update and drops groups older than trainer.max_staleness — remove "
                f"it (or use step_order=replay_buffer)."
            )
    if tr.max_staleness and not (rc.rollout_is or rc.bypass_mode):  # presets are expanded by now
        errs.append(
            "algorithm.rollout_correction.rollout_is: step_order=async trains on samples up to "
            f"trainer.max_staleness={tr.max_staleness} weight versions old, which need a correction "
            "against the policy that sampled them — set rollout_is=token (truncated importance sampling, "
            "rollout_is_threshold 2.0; with the recomputed old log-probs this is the decoupled objective; "
            "add bypass_mode=true to skip that forward), or trainer.max_staleness=0."
        )
    return errs


def _restart_problems(tr: TrainerConfig, warns: list[str]) -> list[str]:
    """Automatic restarts and hang detection: a whole number of restarts >= 0, a stage timeout >= 0 (0: off);
    a warning where they cannot act (in-process workers are the driver's own process)."""
    errs = []
    if not isinstance(tr.max_restarts, int) or tr.max_restarts < 0:
        errs.append(
            f"trainer.max_restarts: {tr.max_restarts!r} must be a whole number >= 0 (0: no restarts)."
        )
    timeout = tr.stage_timeout_s
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout < 0:
        errs.append(f"trainer.stage_timeout_s: {timeout!r} must be a finite number >= 0 (0: no limit).")
    if not tr.use_ray and (tr.max_restarts or timeout):
        warns.append(
            "trainer.max_restarts / trainer.stage_timeout_s act on Ray workers only; with "
            "trainer.use_ray=false the workers run in the driver's process, whose death or hang no restart "
            "can catch."
        )
    return errs


def _lora_problems(model: ModelConfig, strategy: str) -> list[str]:
    """LoRA keys of `actor_rollout_ref.model`: a rank >= 0, a positive alpha, `target_modules` all-linear or
    a list of names, and a training engine that builds adapters (torch, fsdp2, deepspeed). Whether the names
    match modules of the model is checked when the model is loaded (`dapo_core.compute.lora`)."""
    key = "actor_rollout_ref.model"
    rank, alpha, targets = model.lora_rank, model.lora_alpha, model.target_modules
    errs = []
    if not isinstance(rank, int) or rank < 0:
        errs.append(
            f"{key}.lora_rank: {rank!r} must be an integer >= 0 — 0 trains every weight, 8 to 64 is usual."
        )
        return errs
    if rank == 0:
        return errs
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        errs.append(f"{key}.lora_alpha: {alpha!r} must be > 0 — verl's default is 16; 2·lora_rank is common.")
    names_ok = isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    if targets not in allowed("AllLinear") and not names_ok:
        errs.append(
            f"{key}.target_modules: {targets!r} is neither 'all-linear' nor a list of module names — use "
            "all-linear, or e.g. [q_proj, k_proj, v_proj, o_proj]."
        )
    excl = model.exclude_modules
    if excl is not None and not isinstance(excl, (str, list)):
        errs.append(
            f"{key}.exclude_modules: {excl!r} must be null, a regex string or a list of module names."
        )
    if strategy not in ("torch", "fsdp", "fsdp2", "deepspeed"):  # dapo_core.compute.lora.LORA_STRATEGIES
        errs.append(
            f"{key}.lora_rank: {rank} asks for LoRA adapters, which the torch, fsdp2 and deepspeed training "
            f"engines build and actor_rollout_ref.actor.strategy={strategy!r} does not — set "
            "actor_rollout_ref.actor.strategy=fsdp2 or deepspeed (sharded over the data-parallel ranks) or "
            "strategy=torch (one process, CPU or one GPU) for LoRA, or lora_rank=0 to train every weight "
            "with this strategy."
        )
    return errs


def _collect_problems(c: DapoConfig) -> tuple[list[str], list[str]]:
    """All cross-field problems of a loaded config: (errors, warnings), each 'key: problem — fix'."""
    errs: list[str] = []
    warns: list[str] = []
    arr, alg = c.actor_rollout_ref, c.algorithm
    actor, rollout = arr.actor, arr.rollout
    data = c.data

    errs.extend(_closed_set_problems(c))
    strategy = actor.strategy
    if strategy in ("fsdp", "megatron"):
        errs.append(
            f"actor_rollout_ref.actor.strategy: {strategy!r} (a verl engine) is not available here — use "
            "'fsdp2' for data-parallel sharded training, 'deepspeed' (ZeRO, one device) or 'torch' for one "
            "device."
        )
    elif strategy not in allowed("Strategy"):
        errs.append(
            f"actor_rollout_ref.actor.strategy: {strategy!r} is not one of {list(allowed('Strategy'))}."
        )
    tr = c.trainer
    ranks = tr.nnodes * tr.n_gpus_per_node
    if tr.nnodes < 1 or tr.n_gpus_per_node < 1:
        errs.append("trainer.nnodes / trainer.n_gpus_per_node: must be >= 1.")
    elif strategy == "fsdp2" and ranks > 1 and not tr.use_ray:
        errs.append(
            f"trainer.nnodes × trainer.n_gpus_per_node = {ranks} data-parallel ranks run as Ray actors, but "
            "trainer.use_ray=false — set trainer.use_ray=true, or both to 1."
        )
    elif strategy != "fsdp2" and tr.nnodes > 1:
        errs.append(
            f"trainer.nnodes: {tr.nnodes} nodes, but actor_rollout_ref.actor.strategy={strategy!r} trains "
            "in one process on one node — set actor_rollout_ref.actor.strategy=fsdp2 (data-parallel ranks "
            "over trainer.nnodes × trainer.n_gpus_per_node), or trainer.nnodes=1."
        )
    mp = actor.fsdp_config.mixed_precision
    if (
        strategy == "deepspeed"
        and not actor.deepspeed.bf16
        and mp.param_dtype in TRAIN_DTYPES
        and train_dtype(mp.param_dtype) != "float32"
    ):
        warns.append(
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype: bf16, but the deepspeed engine "
            "reads its precision from its own config and trains in float32 — set "
            "actor_rollout_ref.actor.deepspeed.bf16=true for bf16."
        )
    errs.extend(_lora_problems(arr.model, strategy))
    if actor.deepspeed.zero_stage not in allowed("ZeroStage"):
        errs.append("actor_rollout_ref.actor.deepspeed.zero_stage: must be 0, 1, 2 or 3.")
    if actor.deepspeed.offload_param and actor.deepspeed.zero_stage != 3:
        errs.append("actor_rollout_ref.actor.deepspeed.offload_param: needs zero_stage 3 — set zero_stage=3.")
    for key in _POSITIVE_INTS:
        if _get(c, key) < 1:
            errs.append(f"{key}: {_get(c, key)} must be >= 1.")
    for key in _OPTIONAL_POSITIVE_INTS:
        v = _get(c, key)
        if v is not None and v < 1:
            errs.append(f"{key}: {v} must be >= 1 or null.")

    # --- batch arithmetic
    n = rollout.n
    tbs, mini = data.train_batch_size, actor.ppo_mini_batch_size
    gbs = data.gen_batch_size if data.gen_batch_size is not None else tbs
    if mini >= 1 and tbs % mini:
        errs.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size: {mini} does not divide data.train_batch_size {tbs}"
            " — choose a divisor."
        )
    micro = actor.ppo_micro_batch_size_per_gpu
    if micro and n >= 1 and (mini * n) % micro:
        errs.append(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: {micro} does not divide "
            f"ppo_mini_batch_size x rollout.n = {mini * n} trajectories — choose a divisor."
        )
    cmini = c.critic.ppo_mini_batch_size or mini
    cmicro = c.critic.ppo_micro_batch_size_per_gpu
    if tbs % cmini:
        errs.append(f"critic.ppo_mini_batch_size: {cmini} does not divide data.train_batch_size {tbs}.")
    if cmicro and (cmini * n) % cmicro:
        errs.append(
            f"critic.ppo_micro_batch_size_per_gpu: {cmicro} does not divide critic mini-batch x rollout.n"
            f" = {cmini * n} trajectories."
        )
    fg = alg.filter_groups
    if fg.enable:
        if gbs < tbs:
            errs.append(
                f"data.gen_batch_size: {gbs} < data.train_batch_size {tbs} with dynamic sampling — "
                "set gen_batch_size >= train_batch_size (DAPO: 3x)."
            )
        if fg.max_num_gen_batches < 0:
            errs.append("algorithm.filter_groups.max_num_gen_batches: must be >= 0 (0 = unlimited).")
        if not fg.metric:
            errs.append("algorithm.filter_groups.metric: required when enabled — use acc (as the 32B runs).")
        elif fg.metric not in FILTER_METRICS:
            warns.append(
                f"algorithm.filter_groups.metric: {fg.metric!r} is not one of {list(FILTER_METRICS)}; it "
                "must be a key the reward function returns in its extra info."
            )

    # --- loss (loss_agg_mode: a closed set, checked above)
    if actor.clip_ratio_c <= 1.0:
        errs.append(
            f"actor_rollout_ref.actor.clip_ratio_c: {actor.clip_ratio_c} must be > 1 (dual-clip lower "
            "bound) — DAPO uses 10.0."
        )
    for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = getattr(actor, k)
        if v is not None and v < 0:
            errs.append(f"actor_rollout_ref.actor.{k}: {v} must be >= 0.")
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    if low >= 1.0:
        errs.append(
            f"actor_rollout_ref.actor.clip_ratio_low: {low} must be < 1 (the lower clip is 1 - eps_low)."
        )
    pl = actor.policy_loss
    if pl.loss_mode not in POLICY_LOSS_REGISTRY:
        warns.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode: {pl.loss_mode!r} is not a registered loss "
            f"{sorted(POLICY_LOSS_REGISTRY)}; it must be registered with register_policy_loss before "
            "training."
        )
    if pl.loss_mode == "dro" and pl.dro_beta <= 0:
        errs.append("actor_rollout_ref.actor.policy_loss.dro_beta: must be > 0 for loss_mode=dro.")

    # --- advantage and KL
    est = alg.adv_estimator
    if est not in ADV_ESTIMATOR_REGISTRY:
        errs.append(f"algorithm.adv_estimator: {est!r} is not one of {sorted(ADV_ESTIMATOR_REGISTRY)}.")
    elif est in GROUP_ESTIMATORS and n < 2:
        warns.append(
            f"actor_rollout_ref.rollout.n: {n} with group estimator {est!r} gives singleton groups (no "
            "baseline) — use n >= 2 (DAPO: 16)."
        )
    for key, v in (
        ("algorithm.kl_penalty", alg.kl_penalty),
        ("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type),
    ):
        if v.removesuffix("+") not in KL_KINDS:
            fix = (
                "'full' is not implemented by the reference"
                if v == "full"
                else f"use one of {list(KL_KINDS)}"
            )
            errs.append(f"{key}: {v!r} is not a KL estimator — {fix} (optionally with a '+' suffix).")
    if alg.kl_ctrl.type == "adaptive" and alg.kl_ctrl.horizon <= 0:
        errs.append("algorithm.kl_ctrl.horizon: must be > 0 for the adaptive controller.")

    # --- rollout correction (the algo layer's parsers: the same rules as at run time)
    rc = alg.rollout_correction
    prefix = "algorithm.rollout_correction"
    n_errs = len(errs)
    if rc.rollout_is not in (None, *SUPPORTED_ROLLOUT_IS_LEVELS):
        errs.append(
            f"{prefix}.rollout_is: {rc.rollout_is!r} must be null, "
            + " or ".join(SUPPORTED_ROLLOUT_IS_LEVELS)
            + "."
        )
    if rc.rollout_is is not None or isinstance(rc.rollout_is_threshold, bool):
        problem = _problem(parse_is_threshold, rc.rollout_is_threshold)
        if problem:
            errs.append(f"{prefix}.rollout_is_threshold: {problem}.")
    rs = rc.rollout_rs
    if rs is not None and str(rs).strip():
        problem = _problem(parse_rs_option_names, rs)
        if problem:
            errs.append(f"{prefix}.rollout_rs: {problem}.")
        else:
            problem = _problem(parse_rs_options, rs, rc.rollout_rs_threshold)
            if problem:
                errs.append(f"{prefix}.rollout_rs_threshold: {problem}.")
    if len(errs) == n_errs and rc.loss_type in SUPPORTED_LOSS_TYPES:
        # anything the run would still refuse
        problem = _problem(RolloutCorrection.from_dict, dataclasses.asdict(rc))
        if problem:
            errs.append(f"{prefix}: {problem}.")
    if (rc.rollout_is or rc.rollout_rs or rc.bypass_mode) and not rollout.calculate_log_probs:
        errs.append(
            "actor_rollout_ref.rollout.calculate_log_probs: rollout correction needs the engine's log-probs "
            "— set it to true."
        )

    # --- overlong shaping
    ob = c.reward_model.overlong_buffer
    if ob.enable:
        L = data.max_response_length
        if not 0 < ob.len < L:
            errs.append(
                f"reward_model.overlong_buffer.len: {ob.len} must be > 0 and < data.max_response_length "
                f"{L} — DAPO uses 4096 of 20480."
            )
        if ob.penalty_factor < 0:
            errs.append("reward_model.overlong_buffer.penalty_factor: must be >= 0 (DAPO: 1.0).")

    # --- sampling parameters
    sampling: tuple[tuple[str, RolloutConfig | ValKwargsConfig | EvalConfig], ...] = (
        ("actor_rollout_ref.rollout", rollout),
        ("actor_rollout_ref.rollout.val_kwargs", rollout.val_kwargs),
        ("eval", c.eval),
    )
    for prefix, sec in sampling:
        if not 0 < sec.top_p <= 1:
            errs.append(f"{prefix}.top_p: {sec.top_p} must be in (0, 1].")
        if sec.top_k == 0 or sec.top_k < -1:
            errs.append(f"{prefix}.top_k: {sec.top_k} must be -1 (off) or >= 1.")
        # eval has no do_sample: `dapo eval` samples when temperature > 0 and decodes greedily at 0.
        if sec.temperature < 0 or (sec.temperature == 0 and getattr(sec, "do_sample", prefix != "eval")):
            errs.append(f"{prefix}.temperature: {sec.temperature} must be > 0 when sampling.")

    # --- step order
    if tr.step_order == "async":
        errs.extend(_async_problems(c))
    if tr.step_order == "replay_buffer" and tbs % max(tr.parameter_sync_step, 1):
        errs.append(
            f"trainer.parameter_sync_step: {tr.parameter_sync_step} does not divide data.train_batch_size "
            f"{tbs} (replay_buffer order) — choose a divisor."
        )
    if tr.resume_mode == "resume_path" and not tr.resume_from_path:
        errs.append(
            "trainer.resume_from_path: required for resume_mode=resume_path — give a checkpoint folder."
        )
    errs.extend(_restart_problems(tr, warns))
    bad_loggers = [x for x in tr.logger if x not in allowed("LoggerName")]
    if bad_loggers:
        errs.append(f"trainer.logger: {bad_loggers} not available — use {', '.join(allowed('LoggerName'))}.")

    # --- optimizers and small models
    for prefix, o in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", c.critic.optim)):
        if o.lr <= 0:
            errs.append(f"{prefix}.lr: {o.lr} must be > 0.")
        if not 0 <= o.lr_warmup_steps_ratio <= 1:
            errs.append(f"{prefix}.lr_warmup_steps_ratio: must be in [0, 1].")
        if not 0 <= o.min_lr_ratio <= 1:
            errs.append(f"{prefix}.min_lr_ratio: must be in [0, 1].")
        if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
            errs.append(f"{prefix}.betas: {o.betas} must be two numbers in [0, 1).")
    syn = data.synthetic
    if syn.min_value > syn.max_value:
        errs.append("data.synthetic.min_value: must be <= max_value.")
    # "/" only in word problems (exact division); arithmetic expressions use the others
    allowed_ops = [op for op in allowed("SyntheticOp") if syn.kind == "word" or op != "/"]
    bad_ops = [op for op in syn.ops if op not in allowed_ops]
    if bad_ops or not syn.ops:
        errs.append(f"data.synthetic.ops: {syn.ops} — use a non-empty subset of {allowed_ops}.")
    if syn.kind not in allowed("SyntheticKind"):
        errs.append(f"data.synthetic.kind: {syn.kind!r} — use 'arith' or 'word'.")
    elif syn.kind == "word" and not 2 <= syn.num_operands <= 4:
        errs.append("data.synthetic.num_operands: word problems take 2..4 numbers (1 to 3 operations).")
    tiny = arr.model.tiny
    if tiny.num_key_value_heads >= 1 and tiny.num_attention_heads % tiny.num_key_value_heads:
        errs.append("actor_rollout_ref.model.tiny.num_key_value_heads: must divide num_attention_heads.")
    if not arr.model.path:
        total = data.max_prompt_length + data.max_response_length
        if total > tiny.max_position_embeddings:
            warns.append(
                f"actor_rollout_ref.model.tiny.max_position_embeddings: {tiny.max_position_embeddings} < "
                f"max_prompt_length + max_response_length = {total} — raise it or shorten the lengths."
            )
    sft = arr.model.sft
    if sft.steps < 0 or sft.lr <= 0:
        errs.append("actor_rollout_ref.model.sft: steps must be >= 0 and lr > 0.")

    for key, what in _POSITIVE_FLOATS.items():
        v = _get(c, key)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            errs.append(f"{key}: {v!r} must be a finite number > 0 — {what}.")
    for key, (zero_ok, what) in _UNIT_INTERVAL.items():
        v = _get(c, key)
        ok = isinstance(v, (int, float)) and (0 <= v <= 1 if zero_ok else 0 < v <= 1)
        if not ok:
            errs.append(f"{key}: {v!r} must be in {'[0' if zero_ok else '(0'}, 1] — {what}.")

    # --- the rollout replicas' layout (dapo_core.compute.replicas.replica_layout)
    tp = rollout.tensor_model_parallel_size
    world = tr.nnodes * tr.n_gpus_per_node
    if tr.n_gpus_per_node < 1:
        errs.append("trainer.n_gpus_per_node: must be >= 1 (devices per node; processes per node on CPU).")
    elif tp >= 1 and world % tp:
        errs.append(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size: {tp} does not divide the {world} devices "
            "of trainer.nnodes × trainer.n_gpus_per_node (each rollout replica takes that many) — choose one "
            "that divides them, or change trainer.n_gpus_per_node."
        )
    elif tp > 1 and rollout.name != "vllm":
        errs.append(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size: {tp} needs the vllm engine "
            f"(rollout.name={rollout.name!r} has no tensor parallelism) — set rollout.name=vllm, or 1."
        )

    # --- keys accepted only at their default until implemented (dapo_core.config.unused)
    errs.extend(not_implemented_problems(c))
    return errs, warns


def no_op_warnings(c: DapoConfig) -> list[str]:
    """A 'key: ... — fix' warning for every `NO_OPS` key (accepted, deliberately ignored) of the loaded config
    `c` set to something other than its default (the user may expect an effect). The CLI prints them once at
    the start of `dapo train` (not at every load, which happens in every task)."""
    out = []
    for key, reason in NO_OPS.items():
        value = _get(c, key)
        default = default_value(key)
        if value != default:
            out.append(
                f"{key}: {value!r} is accepted but has no effect here ({reason}) — remove it to silence this."
            )
    return out
