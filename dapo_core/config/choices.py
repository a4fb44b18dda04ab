"""The closed sets of values of config fields, each defined once as a `Literal`.

The schema annotates such a field with one of these names (`step_order: StepOrder = "sync"`). A type checker
sees the `Literal`, so setting `cfg.trainer.step_order = "asynch"` in code, or passing a field where another
set is expected, is caught before a run. OmegaConf cannot hold a `Literal` (it refuses the annotation, and its
Enums match members by name, which cannot spell `token-mean`), so at run time every name below is `str`, the
type OmegaConf stores and checks (`ZeroStage`'s is `int`). `LITERALS` keeps the `Literal`s:
`dapo_core.config.checks` reads the schema's annotations through it and refuses a value outside its set with
one line naming the key and the allowed values. Sets that code can extend at run time (advantage estimators,
policy losses, dynamic-sampling metrics) stay `str` fields checked against their registries.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any, Literal

from dapo_core.algo.losses import LossAggMode
from dapo_core.algo.rollout_correction.config import BypassLossType, RolloutIsLevel

__all__ = [
    "LITERALS",
    "AllLinear",
    "BypassLossType",
    "Device",
    "KlCtrlType",
    "LoggerName",
    "LossAggMode",
    "OffPolicyStrategy",
    "RefDtype",
    "Refill",
    "ResumeMode",
    "RolloutDtype",
    "RolloutIsLevel",
    "RolloutName",
    "StepOrder",
    "Strategy",
    "SyntheticKind",
    "SyntheticOp",
    "TargetModules",
    "TrainDtype",
    "Truncation",
    "WarmupStyle",
    "WeightTransport",
    "ZeroStage",
    "allowed",
]

# data
Truncation = Literal["left", "right", "error"]
SyntheticKind = Literal["arith", "word"]
SyntheticOp = Literal["+", "-", "*", "/"]
# model, actor, rollout, reference
AllLinear = Literal["all-linear"]
Strategy = Literal["torch", "deepspeed", "fsdp2"]
WarmupStyle = Literal["constant", "cosine"]
ZeroStage = Literal[0, 1, 2, 3]
TrainDtype = Literal["float32", "bfloat16", "fp32", "bf16"]
RolloutName = Literal["hf", "vllm"]
RolloutDtype = Literal["auto", "float32", "bfloat16"]
RefDtype = Literal["float32", "bfloat16"]
WeightTransport = Literal["auto", "same_device", "broadcast"]
# algorithm (LossAggMode, RolloutIsLevel and BypassLossType are the algo layer's, which implements them)
KlCtrlType = Literal["fixed", "adaptive"]
Refill = Literal["fixed", "adaptive"]
# trainer
ResumeMode = Literal["auto", "disable", "resume_path"]
StepOrder = Literal["sync", "async", "replay_buffer"]
OffPolicyStrategy = Literal["drop", "wait"]
Device = Literal["cpu", "cuda", "auto"]
LoggerName = Literal["console", "jsonl", "tensorboard"]

LITERALS: dict[str, Any] = {
    name: value for name, value in list(globals().items()) if typing.get_origin(value) is Literal
}
"""Every closed set above by its name, as the `Literal` (the checks evaluate the schema's annotations with
these)."""

if TYPE_CHECKING:
    TargetModules = AllLinear | list[str]
    """LoRA targets: all-linear, or a list of module names."""
else:
    # What OmegaConf stores: the type of the set's values (str; int for ZeroStage); `target_modules` is a
    # string or a list.
    globals().update({name: type(typing.get_args(lit)[0]) for name, lit in LITERALS.items()})
    TargetModules = Any


def allowed(name: str) -> tuple[Any, ...]:
    """The values of the closed set `name` (a key of `LITERALS`), in the order written above."""
    return typing.get_args(LITERALS[name])
