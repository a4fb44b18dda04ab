"""Stage manifests: the JSON file that commits a stage file, and the names and errors of the stage store.

``step_<n>/<stage>.manifest.json`` names the stage's Arrow file, its size and sha256, the rows and schema hash
of the stage's view, the columns the file holds, the stages it was written over (``base``), the columns stored
as run-length ends (``encoded``) and the writer's ``meta``. It is written last and atomically: a stage is
committed exactly when its manifest exists. Only :data:`FORMAT` is read; a manifest of another format is
refused, naming the file and the fix. The layout and the commit rule: ``docs/STORE.md``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from dapo_core.errors import DapoUserError
from dapo_core.store.files import atomic_write_bytes

__all__ = [
    "FORMAT",
    "STEP_DIR_RE",
    "StageNotCommitted",
    "StageRef",
    "StoreCorruption",
    "StoreError",
    "base_refs",
    "check_stage",
    "check_step",
    "load_manifest",
    "local_path",
    "schema_hash",
    "write_manifest",
]

FORMAT = 3
"""The manifest format this code writes and reads (column deltas and run-length ends)."""
MANIFEST_SUFFIX = ".manifest.json"
STAGE_RE = re.compile(r"^[a-z0-9_]+$")
STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_REQUIRED = ("sha256", "bytes", "file", "rows", "columns", "schema_hash", "file_columns", "selection")

StageRef = tuple[int, str]
"""(step, stage) of a stage file in the same run folder."""


class StoreError(DapoUserError, ValueError):
    """A run-store operation was given a bad argument or found the store in an unusable state."""


class StageNotCommitted(StoreError, KeyError):
    """A stage was read that has no committed manifest (it never finished, or it was deleted)."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class StoreCorruption(StoreError):
    """A committed file does not match its manifest (checksum, size or format)."""


def check_stage(stage: str) -> str:
    """``stage`` if it is a valid stage name (lowercase letters, digits, ``_``), else :class:`StoreError`."""
    if not isinstance(stage, str) or not STAGE_RE.match(stage):
        raise StoreError(
            f"stage name {stage!r} is invalid: use lowercase letters, digits and '_' only "
            f"(e.g. 'generate_g0', 'old_log_prob')"
        )
    return stage


def check_step(step: int) -> int:
    """``step`` if it is a non-negative int, else :class:`StoreError`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StoreError(f"step {step!r} is invalid: pass a non-negative int")
    return step


def local_path(uri: str) -> Path | None:
    """The local path of a ``file://`` URL or a plain path; None for another URL scheme."""
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    if "://" not in uri:
        return Path(uri)
    return None


def schema_hash(schema: pa.Schema) -> str:
    """A short stable hash of an Arrow schema's field names, types and nullability (metadata ignored)."""
    text = "|".join(f"{f.name}:{f.type}:{int(f.nullable)}" for f in schema)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def base_refs(man: dict[str, Any]) -> list[StageRef]:
    """The ``(step, stage)`` refs a manifest's stage was written over (empty: a whole table)."""
    return [(int(s), str(n)) for s, n in man.get("base", [])]


def load_manifest(man_path: Path, step: int, stage: str) -> dict[str, Any]:
    """The manifest at ``man_path`` (of ``stage`` at ``step``), checked for the keys and format it must have.

    Raises :class:`StageNotCommitted` when it does not exist, :class:`StoreCorruption` when it is unreadable
    and :class:`StoreError` when it is of another format than :data:`FORMAT`.
    """
    try:
        text = man_path.read_bytes()
    except FileNotFoundError:
        raise StageNotCommitted(
            f"stage {stage!r} of step {step} is not committed (no {man_path.name} in "
            f"{man_path.parent}): run the stage first"
        ) from None
    unreadable = StoreCorruption(
        f"manifest {man_path} is unreadable: delete_stage({step}, {stage!r}) and re-run the stage"
    )
    try:
        man = json.loads(text)
        ok = isinstance(man, dict) and all(k in man for k in ("sha256", "bytes", "file"))
        fmt = int(man.get("format", 1)) if ok else 0
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise unreadable
    if fmt != FORMAT:
        newer = fmt > FORMAT
        who = "a newer dapo" if newer else "a development version of dapo (a format no release wrote)"
        raise StoreError(
            f"{man_path} has manifest format {fmt}, {'newer' if newer else 'older'} than this code reads "
            f"({FORMAT}): the run folder was written by {who}",
            fix=(
                "upgrade this checkout to the version that wrote the run, or start a new run"
                if newer
                else "start a new run (a new trainer.experiment_name, or delete the run folder)"
            ),
        )
    if not all(k in man for k in _REQUIRED):
        raise unreadable
    return man


def write_manifest(
    man_path: Path,
    *,
    step: int,
    stage: str,
    view: dict[str, Any],
    file_columns: list[str],
    selection: bool,
    encoded: dict[str, str],
    sha256: str,
    nbytes: int,
    meta: Any,
    base: list[StageRef],
) -> dict[str, Any]:
    """Write (atomically, the directory fsynced) the manifest that commits a stage file; returns it.

    ``view``: ``rows``, ``schema_hash``, ``columns`` and ``view_bytes`` of the stage's view.
    """
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "stage": stage,
        "file": f"{stage}.arrow",
        **view,
        "file_columns": file_columns,
        "selection": selection,
        "encoded": encoded,
        "sha256": sha256,
        "bytes": nbytes,
        "meta": meta,
        "created": time.time(),
    }
    if base:
        manifest["base"] = [list(r) for r in base]
    atomic_write_bytes(man_path, json.dumps(manifest, sort_keys=True, indent=1).encode())
    return manifest
