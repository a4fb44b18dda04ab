"""Structured configuration for dapo: the entry point for loading, overrides and validation.

The schema (`dapo_core.config.schema`) is a tree of dataclasses turned into an OmegaConf structured config,
with verl's key paths and the reference's defaults (the base config is *not* DAPO; `configs/tiny_cpu.yaml`
and `configs/dapo_*_qwen2.5_32b.yaml` are); the cross-field checks live in `dapo_core.config.checks`, and the
package `dapo_core.config` exports the schema classes and this module's names.

Loading (`load_config`): schema defaults <- YAML file (and the chain of files named by its top-level
`base:` key, resolved relative to the including file) <- dotted overrides (`a.b.c=1`, verl-style
`+a.b.c=1`). Every unknown key or wrong type is reported with its full dotted path and the closest valid
key; then `validate_config` runs the cross-field checks and reports all problems at once.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import hashlib
import inspect
import itertools
import os
import re
import typing
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml  # type: ignore[import-untyped, unused-ignore]
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dapo_core.algo.rollout_correction import RolloutCorrection
from dapo_core.config.checks import (
    _collect_problems,
)
from dapo_core.config.schema import (
    DapoConfig,
)
from dapo_core.errors import DapoUserError

S = TypeVar("S")

__all__ = [
    "ConfigError",
    "ConfigWarning",
    "all_keys",
    "config_hash",
    "field_docs",
    "gen_batch_size",
    "load_config",
    "load_config_text",
    "need_ref_worker",
    "need_reference_policy",
    "off_policy_threshold",
    "resolve_device",
    "runs_ahead",
    "section",
    "sync_parts",
    "to_safe_yaml",
    "to_yaml",
    "typed",
    "use_critic",
    "validate_config",
]


class ConfigError(DapoUserError, ValueError):
    """A configuration problem: unknown key, wrong type, or inconsistent values (the message lists each)."""


class ConfigWarning(UserWarning):
    """A configuration that is legal but probably not what the user meant."""


# ------------------------------------------------------------------------------------ introspection
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Return {field name: its one-line docstring} for a config dataclass (read from the source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if is_field and is_doc and isinstance(nxt.value.value, str):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def _walk_schema(cls: type = DapoConfig, prefix: str = "") -> Iterator[tuple[str, type, str]]:
    """Yield (dotted key, owning dataclass, field name) for every leaf and section of the schema."""
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        yield key, cls, f.name
        sub = f.default_factory() if f.default_factory is not MISSING else None
        if is_dataclass(sub):
            yield from _walk_schema(type(sub), key + ".")


def all_keys() -> list[str]:
    """Every dotted key of the schema, sections included (e.g. `algorithm.filter_groups.enable`)."""
    return [k for k, _, _ in _walk_schema()]


_STR_OR_LIST = {"data.train_files", "data.val_files", "eval.files", "trainer.logger"}
"""List-typed keys that also accept a single string (as verl scripts pass them)."""


# -------------------------------------------------------------------------------------- key checks
def _suggest(key: str, parent: Any) -> str:
    """A ' — did you mean X?' hint for an unknown dotted key (siblings first, then any leaf)."""
    leaf = key.rsplit(".", 1)[-1]
    siblings = [str(k) for k in parent] if isinstance(parent, DictConfig) else []
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    everywhere = all_keys()
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in everywhere}
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    if close:
        return f"did you mean {by_leaf[close[0]]}?"
    close = difflib.get_close_matches(key, everywhere, n=1, cutoff=0.5)
    if close:
        return f"did you mean {close[0]}?"
    return "see `dapo config` for the valid keys."


def _unknown_keys(schema: DictConfig, data: Any, prefix: str, where: str) -> list[str]:
    """List a problem line for every key of `data` (a plain dict) that the schema does not have."""
    problems: list[str] = []
    if not isinstance(data, dict):
        return problems
    for k, v in data.items():
        key = f"{prefix}{k}"
        if not isinstance(schema, DictConfig) or k not in schema:
            problems.append(f"{key}: unknown key ({where}) — {_suggest(key, schema)}")
            continue
        child = schema._get_node(k)
        free_form = isinstance(child, DictConfig) and OmegaConf.get_type(child) is dict  # a {name: value} map
        if isinstance(child, DictConfig) and isinstance(v, dict) and not free_form:
            problems.extend(_unknown_keys(child, v, key + ".", where))
    return problems


def _lift_str_lists(data: Any, prefix: str = "") -> Any:
    """Wrap a string given for a list-typed key in `_STR_OR_LIST` into a one-element list."""
    if isinstance(data, dict):
        return {k: _lift_str_lists(v, f"{prefix}{k}.") for k, v in data.items()}
    if prefix[:-1] in _STR_OR_LIST and isinstance(data, str) and not data.startswith("${"):
        return [data] if data else []
    return data


def _merge(cfg: DictConfig, data: dict, where: str, problems: list[str]) -> DictConfig:
    """Merge a plain dict into the structured config; on unknown keys or wrong types append problem
    lines to `problems` and return `cfg` unchanged."""
    unknown = _unknown_keys(cfg, data, "", where)
    if unknown:
        problems.extend(unknown)
        return cfg
    try:
        return OmegaConf.merge(cfg, _lift_str_lists(data))  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        problems.append(
            f"{key}: wrong type ({where}): {msg} — give a value of the type documented in configs/dapo.yaml."
        )
        return cfg


# ----------------------------------------------------------------------------------------- loading
@functools.lru_cache(maxsize=32)
def _read_yaml_dict(path: Path, mtime_ns: int) -> dict:
    """Parse a YAML config file into a plain dict (cached per file version; interpolations kept)."""
    del mtime_ns  # part of the cache key only
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {path} is not text: byte {e.start} (line {line}) is not UTF-8 — pass a YAML config "
            "file (e.g. --config configs/tiny_cpu.yaml)."
        ) from None
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise ConfigError(
            f"config file {path} is empty — it would silently mean every schema default; write at least one "
            "section, or start from configs/tiny_cpu.yaml (a file with `base: dapo.yaml` means the defaults)."
        )
    try:
        raw = OmegaConf.create(text)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_problem(str(path), e)) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config file {path}: {str(e).splitlines()[0]} — fix the YAML there.") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections.")
    data = OmegaConf.to_container(raw, resolve=False)
    assert isinstance(data, dict)
    return data


def _yaml_problem(where: str, e: yaml.YAMLError) -> str:
    """One line for a YAML parse error: the file, the line and column, and what the parser expected."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    at = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    what = f"{context}: {problem}" if context else str(problem)
    return f"{where}:{at}: not valid YAML ({what}) — fix the YAML there (indentation, brackets, quotes)."


def _read_yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """Read a YAML file and, first, the files named by its `base:` key (relative to it)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base: cycle of config files: {' -> '.join(str(p) for p in (*seen, path))}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist — pass an existing --config path.")
    data = copy.deepcopy(_read_yaml_dict(path, path.stat().st_mtime_ns))
    base = data.pop("base", None)
    chain: list[tuple[Path, dict]] = []
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base must be a file name such as 'dapo.yaml', got {base!r}.")
        chain = _read_yaml_chain(path.parent / base, (*seen, path))
    return [*chain, (path, data)]


_LOWER_UPPER = re.compile(r"^[0-9.eE+-]+_[0-9.eE+-]+$")
"""A 'lower_upper' threshold pair, kept as a string (quote such values in YAML files)."""


def _parse_override(item: str) -> tuple[str, Any]:
    """Split 'a.b=value' (or verl-style '+a.b=value') into the key and a YAML-parsed value."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. data.train_batch_size=16).")
    key, value = item.split("=", 1)
    key = key.strip().lstrip("+")
    if key.startswith("~"):
        raise ConfigError(f"override {item!r}: deleting keys is not supported — set the key to null instead.")
    if value == "":
        return key, ""
    if _LOWER_UPPER.match(value):  # YAML 1.1 would read "5_0.5" as the number 50.5
        return key, value
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]), resolve=False)
    assert isinstance(parsed, dict)
    return key, parsed["v"]


def _nest(key: str, value: Any) -> dict:
    """Turn 'a.b.c', v into {'a': {'b': {'c': v}}}."""
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Load, override and validate a config.

    `path` is a YAML file (None = schema defaults only); a top-level `base: other.yaml` key makes it
    inherit that file (resolved relative to it, chains allowed). `overrides` are `a.b.c=value` strings
    (a leading `+` as in verl/Hydra is accepted when the key exists). Returns a struct-mode DictConfig
    typed by `DapoConfig`. Raises `ConfigError` naming the full key (and the closest valid key) for an
    unknown key or a wrong type, and listing all cross-field problems (see `validate_config`).
    """
    sources = [] if path is None else [(f.name, d) for f, d in _read_yaml_chain(Path(path))]
    return _build(sources, overrides)


def load_config_text(text: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Like `load_config`, from YAML text (e.g. `to_yaml` output passed between flows and tasks).

    A `base:` key is not allowed in text (there is no file to resolve it against).
    """
    try:
        raw = OmegaConf.create(text)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_problem("config text", e)) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config text is not valid YAML: {e}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError("config text: the top level must be a mapping of sections.")
    data = OmegaConf.to_container(raw, resolve=False)
    assert isinstance(data, dict)
    if "base" in data:
        raise ConfigError("config text: `base:` needs a file — use load_config(path) instead.")
    return _build([("config text", data)], overrides)


_SCHEMA_CACHE: list[DictConfig] = []
"""The structured default config, built once (OmegaConf.structured is slow); callers get deep copies."""


def _schema() -> DictConfig:
    """A fresh copy of the structured default config."""
    if not _SCHEMA_CACHE:
        _SCHEMA_CACHE.append(OmegaConf.structured(DapoConfig))
    return copy.deepcopy(_SCHEMA_CACHE[0])


def _deep_update(dst: dict, src: dict) -> dict:
    """Recursively merge plain dict `src` into `dst` (dicts merge, everything else replaces)."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)
    return dst


def _build(sources: list[tuple[str, dict]], overrides: Sequence[str]) -> DictConfig:
    """Merge (name, dict) sources then overrides into the schema, collecting all problems; validate."""
    cfg = _schema()
    problems: list[str] = []
    named = list(sources)
    for item in overrides:
        try:
            key, value = _parse_override(item)
        except ConfigError as e:
            problems.append(str(e))
            continue
        named.append((f"override {item!r}", _nest(key, value)))
    for where, data in named:
        problems.extend(
            _unknown_keys(cfg, data, "", where if where.startswith("override") else f"in {where}")
        )
    if problems:
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(problems))
    combined: dict = {}
    for _, data in named:
        _deep_update(combined, _lift_str_lists(data))
    try:
        cfg = OmegaConf.merge(cfg, combined)  # type: ignore[assignment]
    except OmegaConfBaseException:
        # Slow path, only to say which file or override holds the bad value.
        cfg = _schema()
        for where, data in named:
            cfg = _merge(cfg, data, where if where.startswith("override") else f"in {where}", problems)
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(problems)) from None
    _expand_rollout_correction_preset(cfg)
    OmegaConf.set_struct(cfg, True)
    validate_config(cfg)
    return cfg


def _expand_rollout_correction_preset(cfg: DictConfig) -> None:
    """Replace `algorithm.rollout_correction`'s keys by its named `preset` (the preset wins over keys given
    beside it; loading the resolved YAML again gives the same section)."""
    rc = cfg.algorithm.rollout_correction
    if rc.preset is None:
        return
    try:
        values = RolloutCorrection.preset(rc.preset).to_dict()
    except ValueError as e:
        raise ConfigError(f"Invalid configuration:\n  algorithm.rollout_correction.preset: {e}") from None
    for key, value in values.items():
        rc[key] = value


def validate_config(cfg: DictConfig) -> None:
    """Run every cross-field check; raise one `ConfigError` listing all problems (key: problem — fix).

    Questionable-but-legal settings are reported as `ConfigWarning`s instead.
    """
    try:
        resolved = typed(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"Invalid configuration:\n  {getattr(e, 'full_key', '?')}: cannot resolve: {e} — "
            "set the environment variable or give the value directly."
        ) from None
    errors, warns = _collect_problems(resolved)
    for w in warns:
        warnings.warn(w, ConfigWarning, stacklevel=2)
    if errors:
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(errors))


def to_yaml(cfg: DictConfig) -> str:
    """The fully resolved config as YAML with sorted keys (what `dapo config` prints and runs store)."""
    return OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True)


SECRET_ENV_NAME = re.compile(r"(?i)(KEY|TOKEN|SECRET|PASS|CREDENTIAL|AUTH|PRIVATE|COOKIE|SESSION)")
"""Environment variable names whose values `to_safe_yaml` never writes out."""


def _mask_secrets(obj: Any, secrets: dict[str, str]) -> Any:
    if isinstance(obj, dict):
        return {k: _mask_secrets(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mask_secrets(v, secrets) for v in obj]
    if isinstance(obj, str):
        for name, value in secrets.items():
            obj = obj.replace(value, "${oc.env:" + name + "}")
    return obj


def to_safe_yaml(cfg: DictConfig) -> str:
    """`to_yaml`, except that the value of any environment variable with a secret-looking name (…KEY, …TOKEN,
    …SECRET, …PASSWORD, …; values of 6+ characters) is written back as the `${oc.env:NAME}` reference it came
    from. What is written to disk or handed to Prefect (run records, flow parameters) uses this, so a secret
    never lands in a file or in Prefect's database; loading the text resolves the reference again."""
    secrets = {k: v for k, v in os.environ.items() if SECRET_ENV_NAME.search(k) and len(v) >= 6}
    data = _mask_secrets(OmegaConf.to_container(cfg, resolve=True), secrets)
    return OmegaConf.to_yaml(OmegaConf.create(data), sort_keys=True)


def config_hash(cfg: DictConfig) -> str:
    """Stable sha256 hex digest of the resolved config (`to_yaml`); equal configs hash equal."""
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def typed(cfg: DictConfig | DapoConfig) -> DapoConfig:
    """The typed view of a loaded config: `DapoConfig` dataclass instances all the way down.

    Fields have their schema types (an `int` field is an `int`), so callers need no casts and a type
    checker follows every access. Interpolations are resolved. A `DapoConfig` is returned unchanged.
    """
    if isinstance(cfg, DapoConfig):
        return cfg
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, DapoConfig)
    return obj


def section(cls: type[S], value: S | Mapping[str, Any]) -> S:
    """`value` as the schema dataclass `cls`: unchanged when it is one; a mapping (a test's or a bench's
    partial section) fills the missing fields from the schema's defaults, nested sections too. An unknown
    key raises TypeError naming it."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{cls.__name__}: expected the section or a mapping, got {type(value).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}; known: {sorted(names)}")
    kwargs = {}
    for k, v in value.items():
        t = hints[k]
        kwargs[k] = section(t, v) if isinstance(t, type) and is_dataclass(t) and isinstance(v, Mapping) else v
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------- helpers
def gen_batch_size(cfg: DictConfig | DapoConfig) -> int:
    """Prompts per generation batch: `data.gen_batch_size`, or `data.train_batch_size` when null."""
    g = cfg.data.gen_batch_size
    return int(cfg.data.train_batch_size if g is None else g)


def need_reference_policy(cfg: DictConfig | DapoConfig) -> bool:
    """True when a KL term needs the frozen reference model (KL in reward or KL loss)."""
    return bool(cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss)


def need_ref_worker(cfg: DictConfig | DapoConfig) -> bool:
    """True when the reference needs a worker (and a model) of its own: KL is used and LoRA is off. With
    LoRA (`actor_rollout_ref.model.lora_rank > 0`) the actor computes it with its adapters off."""
    return need_reference_policy(cfg) and int(cfg.actor_rollout_ref.model.lora_rank) <= 0


def runs_ahead(cfg: DictConfig | DapoConfig) -> bool:
    """True for the step orders whose rollouts run ahead of training through the replay buffer (`async`,
    `replay_buffer`); False for `sync`."""
    return cfg.trainer.step_order != "sync"


def sync_parts(cfg: DictConfig | DapoConfig) -> int:
    """Local updates per global step before the weights go to the rollout: `trainer.parameter_sync_step` in
    the replay-buffer order, 1 in the async order (and in sync)."""
    return int(cfg.trainer.parameter_sync_step) if cfg.trainer.step_order == "replay_buffer" else 1


def off_policy_threshold(cfg: DictConfig | DapoConfig) -> int:
    """The replay buffer's largest span (`global_steps − prompt_global_steps + 1`, the reference's count): the
    async order's `max_staleness + 1` (a group generated during step k−1 and trained at step k has span 2 and
    weight-version lag 1), else `trainer.max_off_policy_threshold`."""
    tr = cfg.trainer
    return int(tr.max_staleness) + 1 if tr.step_order == "async" else int(tr.max_off_policy_threshold)


def use_critic(cfg: DictConfig | DapoConfig) -> bool:
    """True when a critic is built: `critic.enable` if set, else `adv_estimator == "gae"`."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return cfg.algorithm.adv_estimator == "gae"


def resolve_device(cfg: DictConfig | DapoConfig) -> str:
    """`trainer.device` made concrete: "auto" → "cuda" if available else "cpu"; "cuda" must exist."""
    import torch

    device = cfg.trainer.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda requested but no CUDA device is visible — use cpu or auto.")
    return str(device)
