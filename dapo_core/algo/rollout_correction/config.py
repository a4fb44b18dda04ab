"""Rollout-correction settings: the supported option values, parsing of the IS / RS threshold specs, and
``RolloutCorrection`` (the validated form of the ``algorithm.rollout_correction`` config section,
docs/REFERENCE.md §5.1) with its presets (§5.6).

This module is the one definition of the option values and of the threshold parsing: the config checks
(`dapo_core.config.checks`) import them from here. The config section itself is the schema dataclass
`dapo_core.config.RolloutCorrectionConfig` (YAML defaults, untyped thresholds);
`RolloutCorrection.from_dict` turns it into this object. Split out of
:mod:`dapo_core.algo.rollout_correction.core`, which re-exports every public name defined here; import them
from there.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, get_args

__all__ = [
    "SUPPORTED_LOSS_TYPES",
    "SUPPORTED_ROLLOUT_IS_LEVELS",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "BypassLossType",
    "RolloutCorrection",
    "RolloutIsLevel",
    "parse_is_threshold",
    "parse_rs_option_names",
    "parse_rs_options",
]

RolloutIsLevel = Literal["token", "sequence"]
"""Valid values of ``rollout_is`` besides ``None`` (off): the config field's type."""
SUPPORTED_ROLLOUT_IS_LEVELS: tuple[RolloutIsLevel, ...] = get_args(RolloutIsLevel)

SUPPORTED_ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""Rejection-sampling options: ``{token|seq_sum|seq_mean|seq_max}_k{1,2,3}`` (no ``seq_max_k1``)."""

BypassLossType = Literal["ppo_clip", "reinforce"]
"""Bypass-mode policy losses: the config field's type."""
SUPPORTED_LOSS_TYPES: tuple[BypassLossType, ...] = get_args(BypassLossType)


# ----------------------------------------------------------------------------------------------------
# threshold parsing
# ----------------------------------------------------------------------------------------------------


def _parse_positive(value: str, field: str) -> float:
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"{field}={value!r} is not a number; use e.g. 2.0 or '0.5_2.0'") from None
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{field}={value!r} must be a finite number > 0")
    return out


def parse_is_threshold(rollout_is_threshold: float | str) -> tuple[float | None, float, bool]:
    """Parse ``rollout_is_threshold`` into ``(lower, upper, is_icepop)``.

    A number or a number-string is a TIS upper cap (``lower=None``); a ``"lower_upper"`` string selects IcePop
    masking with both bounds. Bools raise ``TypeError`` (``True`` is not a cap); the bounds must satisfy
    ``0 < lower <= upper``.
    """
    if isinstance(rollout_is_threshold, bool):
        raise TypeError(
            f"rollout_is_threshold={rollout_is_threshold!r} is not a boolean setting: give an upper cap such "
            "as 2.0, a 'lower_upper' string such as '0.5_5.0', or set rollout_is=null to disable IS"
        )
    if isinstance(rollout_is_threshold, (int, float)):
        return None, _parse_positive(str(rollout_is_threshold), "rollout_is_threshold"), False
    if not isinstance(rollout_is_threshold, str):
        raise TypeError(
            f"rollout_is_threshold must be a float or a string, got {type(rollout_is_threshold).__name__}"
        )
    text = rollout_is_threshold.strip()
    if not text:
        raise ValueError("rollout_is_threshold is an empty string; use e.g. 2.0 or '0.5_5.0'")
    if "_" in text:
        parts = text.split("_")
        if len(parts) != 2:
            raise ValueError(f"rollout_is_threshold={text!r} must be 'lower_upper', e.g. '0.5_5.0'")
        lower = _parse_positive(parts[0], "rollout_is_threshold (lower)")
        upper = _parse_positive(parts[1], "rollout_is_threshold (upper)")
        if lower > upper:
            raise ValueError(f"rollout_is_threshold={text!r}: lower {lower} must be <= upper {upper}")
        return lower, upper, True
    return None, _parse_positive(text, "rollout_is_threshold"), False


def _split_spec(spec: Any, field: str) -> list[str]:
    if isinstance(spec, bool):
        raise TypeError(f"{field}={spec!r} is not a boolean setting; give option names / thresholds")
    if isinstance(spec, (int, float)):
        return [str(spec)]
    if isinstance(spec, str):
        items = [s.strip() for s in spec.split(",")]
    elif isinstance(spec, Sequence):
        items = []
        for s in spec:
            items.extend(_split_spec(s, field))
    else:
        raise TypeError(f"{field} must be a string, a number or a list, got {type(spec).__name__}")
    if not items or any(not s for s in items):
        raise ValueError(f"{field}={spec!r} has an empty entry; use comma-separated values without blanks")
    return items


def _parse_rs_bound(option: str, spec: str) -> tuple[float | None, float]:
    """Bounds in *statistic* space: ``(log lower, log upper)`` for k1, ``(None, upper)`` for k2/k3."""
    if option.endswith("k1"):
        if "_" in spec:
            parts = spec.split("_")
            if len(parts) != 2:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {option} must be 'lower_upper'")
            lower = _parse_positive(parts[0], f"rollout_rs_threshold (lower, {option})")
            upper = _parse_positive(parts[1], f"rollout_rs_threshold (upper, {option})")
        else:
            upper = _parse_positive(spec, f"rollout_rs_threshold ({option})")
            lower = 1.0 / upper
        if lower > upper:
            raise ValueError(
                f"rollout_rs_threshold {spec!r} for {option}: lower {lower} must be <= upper {upper}"
            )
        return math.log(lower), math.log(upper)
    if "_" in spec:
        raise ValueError(
            f"rollout_rs_threshold {spec!r} for {option}: k2/k3 options take a single upper bound "
            "(e.g. 0.01), not 'lower_upper'"
        )
    return None, _parse_positive(spec, f"rollout_rs_threshold ({option})")


def parse_rs_option_names(rollout_rs: str | Sequence[str]) -> list[str]:
    """The RS option names of ``rollout_rs`` (comma-separated or a list), in order, duplicates kept.

    Raises ``ValueError`` naming the closest supported option for an unknown one (``TypeError`` for a
    boolean).
    """
    options = _split_spec(rollout_rs, "rollout_rs")
    for opt in options:
        if opt not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            close = difflib.get_close_matches(opt, SUPPORTED_ROLLOUT_RS_OPTIONS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"rollout_rs option {opt!r} is not supported{hint}; "
                f"choose from {list(SUPPORTED_ROLLOUT_RS_OPTIONS)}"
            )
    return options


def parse_rs_options(
    rollout_rs: str | Sequence[str], rollout_rs_threshold: Any
) -> list[tuple[str, float | None, float]]:
    """Parse RS options and thresholds into ``[(option, lower_bound, upper_bound), ...]``.

    Options are comma-separated (or a list); duplicates are dropped keeping the first. Thresholds are one spec
    shared by all options or exactly one per listed option. Bounds are returned in statistic space: for k1
    they are ``log(lower), log(upper)`` of the ratio bound (a single number ``u`` means ``[1/u, u]``); for
    k2/k3 the lower bound is ``None``.
    """
    options = parse_rs_option_names(rollout_rs)
    if rollout_rs_threshold is None:
        raise ValueError(
            f"rollout_rs={rollout_rs!r} is enabled but rollout_rs_threshold is None; set e.g. "
            "rollout_rs_threshold='0.999_1.001' (k1) or 0.01 (k2/k3)"
        )
    specs = _split_spec(rollout_rs_threshold, "rollout_rs_threshold")
    if len(specs) == 1:
        specs = specs * len(options)
    elif len(specs) != len(options):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} values for {len(options)} rollout_rs options; "
            "give one value shared by all options or exactly one per option"
        )
    out: list[tuple[str, float | None, float]] = []
    seen: set[str] = set()
    for opt, spec in zip(options, specs, strict=True):
        if opt in seen:
            continue
        seen.add(opt)
        lo, hi = _parse_rs_bound(opt, spec)
        out.append((opt, lo, hi))
    return out


def _check_rollout_is(rollout_is: str | None) -> None:
    if rollout_is is not None and rollout_is not in SUPPORTED_ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r} is not supported; use null (off), 'token' or 'sequence'")


# ----------------------------------------------------------------------------------------------------
# config and presets
# ----------------------------------------------------------------------------------------------------


@dataclass
class RolloutCorrection:
    """The rollout-correction method (§5.1): validated IS / RS settings, built from the
    ``algorithm.rollout_correction`` config section with :meth:`from_dict`, or from a preset.

    Note the dataclass default ``rollout_is="sequence"`` follows verl's dataclass, while the config default
    (``dapo_core.config.RolloutCorrectionConfig``, ``configs/dapo.yaml``) is ``null`` (IS off); use
    :meth:`disabled` or ``from_dict`` of the config section.
    """

    rollout_is: str | None = "sequence"
    """IS level: None (off), "token" or "sequence"."""
    rollout_is_threshold: float | str = 2.0
    """TIS upper cap (number / number-string) or IcePop bounds "lower_upper"."""
    rollout_is_batch_normalize: bool = False
    """Rescale the IS weights to mean 1 (after truncation)."""
    rollout_rs: str | None = None
    """Comma-separated rejection-sampling options (see SUPPORTED_ROLLOUT_RS_OPTIONS); None = off."""
    rollout_rs_threshold: float | str | None = None
    """One RS threshold spec shared by all options, or one per option (comma-separated)."""
    bypass_mode: bool = False
    """False: decoupled (3 policies, recomputed old log-probs); True: bypass (old := rollout log-probs)."""
    loss_type: str = "ppo_clip"
    """Bypass-mode loss: "ppo_clip" (ratio π_θ/π_rollout, no IS weights) or "reinforce" (−w·A·log π_θ)."""

    def __post_init__(self) -> None:
        _check_rollout_is(self.rollout_is)
        if self.rollout_is is not None:
            parse_is_threshold(self.rollout_is_threshold)
        elif isinstance(self.rollout_is_threshold, bool):
            parse_is_threshold(self.rollout_is_threshold)  # raises the TypeError
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(
                f"rollout_correction.loss_type={self.loss_type!r} is not supported; "
                f"use one of {list(SUPPORTED_LOSS_TYPES)}"
            )
        if self.rollout_rs is not None and str(self.rollout_rs).strip():
            parse_rs_options(self.rollout_rs, self.rollout_rs_threshold)

    # -- (de)serialisation ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RolloutCorrection:
        """Build from a mapping (e.g. the YAML section); unknown keys raise naming the closest field.

        Missing keys take the dataclass defaults; ``None`` yields :meth:`disabled`. A ``preset`` key (the
        config's ``algorithm.rollout_correction.preset``) names a preset whose values win over the keys
        beside it.
        """
        if data is None:
            return cls.disabled()
        names = [f.name for f in fields(cls)]
        items = dict(data.items())
        preset = items.pop("preset", None)
        if preset is not None:
            return cls.preset(preset)
        for key in items:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"rollout_correction has no field {key!r}{hint} (fields: {names})")
        return cls(**items)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view (round-trips through :meth:`from_dict`)."""
        return asdict(self)

    # -- presets (§5.6; exact values) ------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> RolloutCorrection:
        """The named preset of `PRESETS`, with any field replaced by `overrides` (e.g.
        ``preset("decoupled_token_icepop", rollout_is_threshold="0.25_4.0")``)."""
        if name not in PRESETS:
            close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown rollout-correction preset {name!r}{hint} (presets: {sorted(PRESETS)})")
        return cls.from_dict({**PRESETS[name], **overrides})

    @classmethod
    def disabled(cls) -> RolloutCorrection:
        """No IS, no RS, decoupled (only the off-policy diagnostics are logged)."""
        return cls.preset("disabled")

    @property
    def is_enabled(self) -> bool:
        """True if IS or RS is configured."""
        return self.rollout_is is not None or bool(self.rollout_rs)


_GEO_RS = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}
_K3_RS = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
_ICEPOP = {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}
_BYPASS_PG = {"bypass_mode": True, "loss_type": "reinforce"}

PRESETS: dict[str, dict[str, Any]] = {
    # decoupled: three policies, old log-probs recomputed; IS and/or RS against the rollout policy
    "decoupled_token_is": {"rollout_is": "token"},
    "decoupled_seq_is": {"rollout_is": "sequence"},
    "decoupled_token_icepop": dict(_ICEPOP),
    "decoupled_seq_is_rs": {
        "rollout_is": "sequence",
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.5_2.0",
    },
    "decoupled_geo_rs": {"rollout_is": None, **_GEO_RS},
    "decoupled_geo_rs_seq_tis": {"rollout_is": "sequence", **_GEO_RS},
    "decoupled_geo_rs_token_tis": {"rollout_is": "token", **_GEO_RS},
    "decoupled_k3_rs": {"rollout_is": None, **_K3_RS},
    "decoupled_k3_rs_seq_tis": {"rollout_is": "sequence", **_K3_RS},
    "decoupled_k3_rs_token_tis": {"rollout_is": "token", **_K3_RS},
    # bypass: old log-probs := rollout log-probs (two policies); PPO clip or REINFORCE with IS weights
    "bypass_ppo_clip": {"rollout_is": None, "bypass_mode": True},
    "bypass_ppo_clip_geo_rs": {"rollout_is": None, **_GEO_RS, "bypass_mode": True},
    "bypass_ppo_clip_k3_rs": {"rollout_is": None, **_K3_RS, "bypass_mode": True},
    "bypass_pg_is": {"rollout_is": "sequence", **_BYPASS_PG},
    "bypass_pg_token_icepop": {**_ICEPOP, **_BYPASS_PG},
    "bypass_pg_geo_rs": {"rollout_is": None, **_GEO_RS, **_BYPASS_PG},
    "bypass_pg_geo_rs_seq_tis": {"rollout_is": "sequence", **_GEO_RS, **_BYPASS_PG},
    "bypass_pg_geo_rs_token_tis": {"rollout_is": "token", **_GEO_RS, **_BYPASS_PG},
    "disabled": {"rollout_is": None},
}
"""The rollout-correction presets (§5.6): name -> the fields that differ from `RolloutCorrection`'s defaults
(IS threshold 2.0, no RS, decoupled, ppo_clip). `algorithm.rollout_correction.preset` selects one."""
