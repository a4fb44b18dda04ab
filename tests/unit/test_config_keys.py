"""Every config key is honoured or refused: each leaf of the schema is read by production code (dapo_core/,
tasks/, flows/, outside dapo_core/config/) or listed in `dapo_core.config.unused` — NOT_IMPLEMENTED keys are
refused at load time unless at their default, NO_OPS keys are deliberate no-ops with a reason.

"Read" is found by a static scan of the source (ast): the leaf name used as an attribute (`x.leaf`), a
subscript or mapping lookup (`x["leaf"]`, `x.get("leaf")`, `.pop`, `.setdefault`), a string in a literal
tuple/list/set of key names, or a keyword argument (`leaf=`). Generic leaf names (`enable`, `n`, `lr`, `seed`,
...) occur all over the code, so a use counts only where it can belong to the key's section:

- strong: an attribute chain that names the parent section (`cfg.data.seed`, `ro.val_kwargs.n`), with the
  grandparent too when the parent's name is ambiguous (`critic.optim.lr` vs `actor.optim.lr`);
- weak: any use in a file that names the parent section (a section passed on as a plain dict, e.g.
  `_plain(cfg.actor_rollout_ref.actor)` handed to `ActorWorker`, whose module reads `cfg["ppo_epochs"]` and
  names `actor` throughout), again with the grandparent when the parent's name is ambiguous;
- through the config helpers (`gen_batch_size(cfg)`, `use_critic(cfg)`, ...): a call from production code
  counts as reading the keys the helper reads.

The scan errs towards "read" (a file that handles two sections with the same leaf names, such as the actor's
and the critic's `optim`, counts for both), so it catches keys that nothing reads; it does not prove that a
listed key stays unread — whoever implements one removes it from the list.
"""

from __future__ import annotations

import ast
import functools
import re
import warnings
from collections import Counter
from pathlib import Path

import pytest

from dapo_core.config import ConfigError, ConfigWarning, all_keys, load_config
from dapo_core.config import loading as config_loading
from dapo_core.config.unused import NO_OPS, NOT_IMPLEMENTED, default_value

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
PRODUCTION = ("dapo_core", "tasks", "flows")
EXCLUDED = tuple(ROOT / "dapo_core" / "config" / f for f in ("schema.py", "checks.py", "unused.py"))
"""The config modules that name every key (schema, cross-field checks, unused list): not evidence of a read.
`loading.py` counts: it reads `algorithm.rollout_correction.preset` to expand the preset."""
HELPERS = ("gen_batch_size", "need_reference_policy", "use_critic", "resolve_device")
"""Config helpers of `dapo_core.config.loading` that read fixed keys for their callers."""

_LOOKUPS = {"get", "pop", "setdefault"}


# -------------------------------------------------------------------------------------------- the scan
class _Uses(ast.NodeVisitor):
    """The names a module uses: attribute reads with their attribute chain, and name-like lookups."""

    def __init__(self) -> None:
        self.attrs: list[tuple[str, tuple[str, ...]]] = []  # (leaf, chain before it, e.g. ("cfg", "data"))
        self.lookups: set[str] = set()  # x["k"], x.get("k"), ("k", ...) literals, k= keywords
        self.calls: set[str] = set()  # names of called functions

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        value = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name):
            chain.append(value.id)
        self.attrs.append((node.attr, tuple(reversed(chain))))
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            self.lookups.add(node.slice.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        self.calls.add(name)
        if name in _LOOKUPS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self.lookups.add(first.value)
        self.lookups.update(k.arg for k in node.keywords if k.arg)
        self.generic_visit(node)

    def _literal(self, node: ast.Tuple | ast.List | ast.Set) -> None:
        for elt in node.elts:
            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                self.lookups.add(elt.value)
        self.generic_visit(node)

    def visit_Tuple(self, node: ast.Tuple) -> None:
        self._literal(node)

    def visit_List(self, node: ast.List) -> None:
        self._literal(node)

    def visit_Set(self, node: ast.Set) -> None:
        self._literal(node)


@functools.cache
def _sources() -> dict[Path, tuple[str, _Uses]]:
    """Every production module except the config modules that name every key: its text and its uses."""
    out = {}
    for top in PRODUCTION:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path in EXCLUDED:
                continue
            text = path.read_text()
            uses = _Uses()
            uses.visit(ast.parse(text))
            out[path] = (text, uses)
    return out


def _sections() -> set[str]:
    keys = all_keys()
    return {k.rsplit(".", 1)[0] for k in keys if "." in k}


def _leaves() -> list[str]:
    sections = _sections()
    return [k for k in all_keys() if k not in sections]


@functools.cache
def _ambiguous_names() -> frozenset[str]:
    """Section names that occur at more than one path (e.g. `optim` under the actor and the critic)."""
    counts = Counter(s.rsplit(".", 1)[-1] for s in _sections())
    return frozenset(name for name, n in counts.items() if n > 1)


def _context(section: str) -> list[str]:
    """The trailing section names a use must be tied to: the section's own name, plus its parent's while the
    name is ambiguous (`critic.optim` -> [critic, optim])."""
    parts = section.split(".")
    n = 1
    while n < len(parts) and parts[-n] in _ambiguous_names():
        n += 1
    return parts[-n:]


def _strong(leaf: str, context: list[str], uses: _Uses) -> bool:
    """An attribute read `....<context>.<leaf>`."""
    k = len(context)
    return any(a == leaf and list(chain[-k:]) == context for a, chain in uses.attrs)


def _weak(leaf: str, context: list[str], text: str, uses: _Uses) -> bool:
    """Any use of `leaf` in a file that names every section of the context."""
    used = leaf in uses.lookups or any(a == leaf for a, _ in uses.attrs)
    return used and all(re.search(rf"\b{re.escape(name)}\b", text) for name in context)


@functools.cache
def _helper_reads() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """Attribute reads inside each config helper (e.g. use_critic reads cfg.critic.enable)."""
    tree = ast.parse(Path(config_loading.__file__).read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in HELPERS:
            uses = _Uses()
            uses.visit(node)
            out[node.name] = uses.attrs
    return out


def _read_by(key: str) -> list[str]:
    """Production files (or `helper()` calls) found to read `key`."""
    section, leaf = key.rsplit(".", 1)
    context = _context(section)
    found = []
    for path, (text, uses) in _sources().items():
        if _strong(leaf, context, uses) or _weak(leaf, context, text, uses):
            found.append(str(path.relative_to(ROOT)))
    called = set().union(*(uses.calls for _, uses in _sources().values()))
    for helper, attrs in _helper_reads().items():
        helper_uses = _Uses()
        helper_uses.attrs = attrs
        if helper in called and _strong(leaf, context, helper_uses):
            found.append(f"{helper}()")
    return found


# ------------------------------------------------------------------------------------------- the tests
def test_helpers_exist_and_read_keys():
    assert set(_helper_reads()) == set(HELPERS)
    assert _read_by("data.gen_batch_size")  # through gen_batch_size(cfg) at least
    assert "use_critic()" in _read_by("critic.enable")


def test_every_schema_key_is_read_or_listed():
    listed = set(NOT_IMPLEMENTED) | set(NO_OPS)
    unread = [key for key in _leaves() if key not in listed and not _read_by(key)]
    assert unread == [], (
        f"config keys that no production code reads: {unread} — read them where the feature lives, or "
        "list them in dapo_core/config/unused.py (NOT_IMPLEMENTED: refused unless at the default; NO_OPS: "
        "with the reason they are ignored)"
    )


def _scan(text: str) -> _Uses:
    uses = _Uses()
    uses.visit(ast.parse(text))
    return uses


def test_scan_ties_generic_names_to_their_section():
    text = (
        "def f(cfg, optim_cfg):\n    return cfg.trainer.seed, optim_cfg['lr']  # the actor's optim section\n"
    )
    uses = _scan(text)
    assert _strong("seed", _context("trainer"), uses)
    assert not _strong("seed", _context("data"), uses) and not _weak("seed", _context("data"), text, uses)
    assert _context("critic.optim") == ["critic", "optim"]  # `optim` alone is ambiguous
    assert _weak("lr", _context("actor_rollout_ref.actor.optim"), text, uses)
    assert not _weak("lr", _context("critic.optim"), text, uses)
    # Real code: keys read from a section handed to a worker as a plain dict are found.
    assert any("workers/actor.py" in f for f in _read_by("actor_rollout_ref.actor.ppo_epochs"))
    assert any("workers/critic.py" in f for f in _read_by("critic.cliprange_value"))
    assert _read_by("data.prompt_key") == []


def test_lists_name_real_leaf_keys_once_with_a_reason():
    leaves = set(_leaves())
    for name, listed in (("NOT_IMPLEMENTED", NOT_IMPLEMENTED), ("NO_OPS", NO_OPS)):
        assert sorted(set(listed) - leaves) == [], f"{name} lists keys that are not schema leaves"
        assert all(reason.strip() for reason in listed.values()), name
    assert set(NOT_IMPLEMENTED) & set(NO_OPS) == set()


def test_dapo_yaml_marks_every_listed_key():
    lines = (ROOT / "configs" / "dapo.yaml").read_text().splitlines()
    path: list[str] = []
    marks = {}
    for line in lines:
        m = re.match(r"( *)([A-Za-z_0-9]+):", line)
        if not m or line.lstrip().startswith("#"):
            continue
        path = [*path[: len(m.group(1)) // 2], m.group(2)]
        marks[".".join(path)] = line
    for key in NOT_IMPLEMENTED:
        assert "NOT IMPLEMENTED YET" in marks[key], key
    for key in NO_OPS:
        assert "NO-OP" in marks[key], key


def _other_value(key: str) -> str:
    """A valid override value different from the key's default."""
    d = default_value(key)
    if isinstance(d, bool):
        return str(not d).lower()
    if isinstance(d, int):
        return str(d + 1)
    if isinstance(d, float):
        return str(d + 0.5)
    if isinstance(d, list) and d and isinstance(d[0], float):
        return "[" + ",".join(str(x / 2) for x in d) + "]"
    if isinstance(d, list):
        return "[" + ",".join(d[:1] if len(d) > 1 else ["other"]) + "]"
    if d is None:
        return "2"
    if key == "critic.optim.warmup_style":
        return "cosine"
    return f"{d}_other"


def _load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(TINY, overrides)


@pytest.mark.parametrize("key", sorted(NOT_IMPLEMENTED))
def test_not_implemented_key_refused_unless_default(key):
    with pytest.raises(ConfigError) as ei:
        _load(f"{key}={_other_value(key)}")
    lines = [ln.strip() for ln in str(ei.value).splitlines() if ln.strip().startswith(f"{key}:")]
    assert len(lines) == 1, str(ei.value)
    assert "not implemented yet" in lines[0] and "remove the key or set it to its default" in lines[0]


def test_not_implemented_keys_at_default_load():
    c = _load(*(f"{key}={_default_text(key)}" for key in NOT_IMPLEMENTED))
    assert c.actor_rollout_ref.actor.use_dynamic_bsz is False


def _default_text(key: str) -> str:
    d = default_value(key)
    if isinstance(d, bool):
        return str(d).lower()
    if isinstance(d, list):
        return "[" + ",".join(str(x) for x in d) + "]"
    return "null" if d is None else str(d)


@pytest.mark.parametrize("key", sorted(NO_OPS))
def test_no_op_key_accepts_other_values(key):
    _load(f"{key}={_other_value(key)}")


# ------------------------------------------------------------------------- one class per config name
def _class_names() -> Counter:
    names: Counter = Counter()
    for path in sorted((ROOT / "dapo_core").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names.update(n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
    return names


def test_config_section_classes_are_defined_once():
    from dataclasses import fields, is_dataclass

    from dapo_core.config import DapoConfig

    def section_classes(cls: type) -> set[type]:
        out = {cls}
        for f in fields(cls):
            sub = f.default_factory() if callable(f.default_factory) else None
            if is_dataclass(sub):
                out |= section_classes(type(sub))
        return out

    names = _class_names()
    twice = sorted(c.__name__ for c in section_classes(DapoConfig) if names[c.__name__] > 1)
    assert twice == [], f"classes defined more than once in dapo_core: {twice}"
