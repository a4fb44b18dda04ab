"""Documentation pointers stay inside the repository.

- No file points at the sibling folder outside the checkout that held our reading notes (users never see it).
- Every `§N` / `§N.M` citation names a section that `docs/REFERENCE.md` has, and a file that cites sections
  also names `docs/REFERENCE.md` (the convention: `docs/REFERENCE.md §N.M`, or a bare `§N.M` once the file has
  named it).
- Every `file.py:function` (or `file.py:Class.method`) that `docs/DAPO.md` names is defined in that file.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "REFERENCE.md"
DAPO_DOC = ROOT / "docs" / "DAPO.md"

TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini"}
TEXT_NAMES = {"Makefile", "run"}  # run = .ci/run
SKIP_PARTS = {".git", "runs", "data", "models", "metrics", "node_modules", "__pycache__"}

# Built from pieces so that this file does not match itself.
OUTSIDE_POINTERS = ("../" + "shared", "shared/" + "reference")

NUM = r"\d+(?:\.\d+)?"
CITATION = re.compile(rf"§§?\s*({NUM}(?:\s*(?:,|-|–|and)\s*(?:§\s*)?{NUM})*)")
"""A numbered citation: `§6.1`, `§ 3`, `§§1, 2`, `§§5.2-5.4`, `§7.1–7.2` (captures the list or range)."""

NAMED_CITATION = re.compile(r"§\s*(Conventions)\b")
OLD_FORMS = re.compile(r"\b(?:reference|verl)\s+§")
"""The old wording ("reference" or "verl" right before the sign), which pointed outside the repository."""

HEADING = re.compile(rf"^#{{2,3}}\s+({NUM})\.?\s")
NAMED_HEADING = re.compile(r"^#{2,3}\s+([A-Z][A-Za-z ]+)$")


def _repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored text files (a walk of the tree when git is unavailable)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.splitlines()
        paths = [ROOT / p for p in out]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in ROOT.rglob("*") if p.is_file()]
    files = []
    for p in paths:
        rel = p.relative_to(ROOT)
        if any(part in SKIP_PARTS or part.startswith(".venv") for part in rel.parts):
            continue
        if (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES) and p.is_file():
            files.append(p)
    return sorted(files)


def _sections() -> tuple[set[str], set[str]]:
    """(numbered sections, named sections) of docs/REFERENCE.md, from its `##` / `###` headings."""
    numbered, named = set(), set()
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        if m := HEADING.match(line):
            numbered.add(m.group(1))
        elif m := NAMED_HEADING.match(line):
            named.add(m.group(1).strip())
    return numbered, named


def _cited(text: str) -> list[str]:
    """Section numbers cited in `text`; a range `a-b` contributes both ends."""
    found = []
    for m in CITATION.finditer(text):
        found += re.findall(NUM, m.group(1))
    return found


FILES = _repo_files()


def test_the_scan_sees_the_tree():
    rels = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert {"README.md", "docs/REFERENCE.md", "pyproject.toml", "dapo_core/masked.py"} <= rels


def test_no_file_points_outside_the_repository():
    bad = []
    for p in FILES:
        for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(s in line for s in OUTSIDE_POINTERS):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "point at docs/ instead (REFERENCE.md, ARCHITECTURE.md, STACK_NOTES.md):\n" + "\n".join(
        bad
    )


def test_reference_headings_are_unique_and_numbered():
    heads = [
        m.group(1)
        for line in REFERENCE.read_text(encoding="utf-8").splitlines()
        if (m := HEADING.match(line))
    ]
    assert len(heads) == len(set(heads)), f"duplicate section numbers in docs/REFERENCE.md: {heads}"
    numbered, named = _sections()
    assert {"1.2", "6.1", "11"} <= numbered and "Conventions" in named


def test_every_section_citation_exists_in_reference():
    numbered, named = _sections()
    bad = []
    for p in FILES:
        text = p.read_text(encoding="utf-8", errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            missing = [s for s in _cited(line) if s not in numbered]
            missing += [s for s in NAMED_CITATION.findall(line) if s not in named]
            if missing:
                bad.append(f"{p.relative_to(ROOT)}:{i}: §{', §'.join(missing)} not in docs/REFERENCE.md")
    assert not bad, "\n".join(bad)


def test_files_that_cite_sections_name_the_reference():
    bad = []
    for p in FILES:
        text = p.read_text(encoding="utf-8", errors="replace")
        if (_cited(text) or NAMED_CITATION.search(text)) and "docs/REFERENCE.md" not in text:
            bad.append(str(p.relative_to(ROOT)))
        for i, line in enumerate(text.splitlines(), 1):
            if OLD_FORMS.search(line):
                bad.append(f"{p.relative_to(ROOT)}:{i}: write `docs/REFERENCE.md §…` ({line.strip()})")
    assert not bad, "cite sections as `docs/REFERENCE.md §N.M`:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("(docs/REFERENCE.md §6.1 step 8, §11 trap 1)", ["6.1", "11"]),
        ("(§§5.2-5.4)", ["5.2", "5.4"]),
        ("(§7.1–7.2 key names)", ["7.1", "7.2"]),
        ("(§§1, 2)", ["1", "2"]),
        ("(§ 3)", ["3"]),
        ("`docs/ARCHITECTURE.md` § The batch contract", []),
    ],
)
def test_citation_parser(text, expected):
    assert _cited(text) == expected


CODE_REF = re.compile(r"`((?:[\w-]+/)*[\w-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`")
"""A `path/to/file.py:name` or `path/to/file.py:Class.method` reference in backticks."""


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _defines(path: Path, qualname: str) -> bool:
    """Whether the Python file at `path` defines `qualname` (a top-level function or class, or a dotted path
    through classes to a method or nested class)."""
    body: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body
    for part in qualname.split("."):
        found = next(
            (node for node in body if isinstance(node, _DEFINITIONS) and node.name == part),
            None,
        )
        if found is None:
            return False
        body = found.body
    return True


def test_dapo_doc_names_functions_that_exist():
    refs = CODE_REF.findall(DAPO_DOC.read_text(encoding="utf-8"))
    assert len(refs) >= 20, f"docs/DAPO.md should name its functions as `file.py:function`; found {refs}"
    bad = []
    for rel, qualname in sorted(set(refs)):
        path = ROOT / rel
        if not path.is_file():
            bad.append(f"{rel}:{qualname}: no file {rel}")
        elif not _defines(path, qualname):
            bad.append(f"{rel}:{qualname}: {rel} defines no {qualname}")
    assert not bad, "docs/DAPO.md points at code that is not there (update the page):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("ref", "exists"),
    [
        ("`dapo_core/algo/losses/core.py:agg_loss`", True),
        ("`dapo_core/compute/workers/actor.py:ActorWorker.update_actor`", True),
        ("`dapo_core/algo/losses/core.py:no_such_function`", False),
        ("`dapo_core/compute/workers/actor.py:ActorWorker.no_such_method`", False),
        ("`dapo_core/compute/workers/actor.py:update_actor`", False),  # a method is not a module function
    ],
)
def test_code_reference_resolver(ref, exists):
    (rel, qualname) = CODE_REF.fullmatch(ref).groups()
    assert _defines(ROOT / rel, qualname) is exists
