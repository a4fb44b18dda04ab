"""Stage files of a run: the checksummed, column-delta Arrow files under ``<root>/step_<n>/``.

:class:`StageFiles` is the store's entry point for stage outputs: write (:meth:`~StageFiles.write_stage`,
:meth:`~StageFiles.write_selection`), read (:meth:`~StageFiles.read_stage`, :meth:`~StageFiles.read_uri`),
check (:meth:`~StageFiles.is_committed`, :meth:`~StageFiles.verify_stage`), list and delete. The parts:
:mod:`.manifests` (the commit record, names and errors), :mod:`.deltas` (what a stage stores over its base,
and its view), :mod:`.stage_io` (one file written hashed, read verified or on trust), :mod:`.run_ends`
(per-token columns stored as run lengths). The store in five calls, the layout and the commit rule:
``docs/STORE.md``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.store import deltas, stage_io, trust
from dapo_core.store.deltas import INTERNAL, KEY_COLUMN, SRC_COLUMN, View, row_keys
from dapo_core.store.files import fsync_dir, unlink_missing_ok
from dapo_core.store.manifests import (
    MANIFEST_SUFFIX,
    STAGE_RE,
    STEP_DIR_RE,
    StageNotCommitted,
    StageRef,
    StoreCorruption,
    StoreError,
    base_refs,
    check_stage,
    check_step,
    load_manifest,
    local_path,
    schema_hash,
    write_manifest,
)
from dapo_core.store.run_ends import encode_file_table
from dapo_core.store.stage_io import io_counters

__all__ = [
    "KEY_COLUMN",
    "SRC_COLUMN",
    "StageFiles",
    "StageNotCommitted",
    "StageRef",
    "StoreCorruption",
    "StoreError",
    "io_counters",
    "row_keys",
    "schema_hash",
]

_MAX_DEPTH = 64
"""The longest base chain followed (a longer one is taken for a cycle)."""


def _meta_json(meta: Mapping[str, Any] | None, what: str) -> Any:
    try:
        return json.loads(json.dumps(dict(meta or {}), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise StoreError(f"{what}: meta is not JSON-serialisable ({e})") from None


class StageFiles:
    """The stage files of the run folder ``root`` (no ledger: safe to open in any worker process).

    Workers open one from the run's root to read their inputs and commit their outputs themselves; the
    driver's :class:`~dapo_core.store.run_store.RunStore` is a ``StageFiles`` plus the ledger and run files.
    Pickling re-opens it from its root on the other side.
    """

    _VIEW_CACHE_SIZE = 2
    """Views kept in memory after a write or read, for unverified reads (a writer compares its table with its
    base without re-reading it: a job's input and its output); a verified read always reads and checks the
    files. Small, since one view can hold most of a step's data."""

    def __init__(self, root: str | Path) -> None:
        local = local_path(str(root))
        if local is None:
            raise StoreError(
                f"store root {root!r} must be a local path or file:// URL (commits need fsync and atomic "
                f"rename; a shared filesystem mounted at the same path on every node is fine)"
            )
        self.root = local.absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self._views: OrderedDict[tuple[int, str, str], View] = OrderedDict()
        self._views_lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"root": str(self.root)}

    def __setstate__(self, state: dict) -> None:
        StageFiles.__init__(self, state["root"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    # ------------------------------------------------------------------ names
    def step_dir(self, step: int) -> Path:
        """The directory of a step's stage outputs: ``root/step_{step:06d}``."""
        return self.root / f"step_{check_step(step):06d}"

    def _paths(self, step: int, stage: str) -> tuple[Path, Path]:
        d = self.step_dir(step)
        check_stage(stage)
        return d / f"{stage}.arrow", d / f"{stage}{MANIFEST_SUFFIX}"

    def stage_uri(self, step: int, stage: str) -> str:
        """The ``file://`` URI of a stage's Arrow file (whether or not it is committed)."""
        return self._paths(step, stage)[0].as_uri()

    def ref_of(self, ref: str | StageRef | Sequence[Any]) -> StageRef:
        """``(step, stage)`` of a stage URI of this run folder (or of a ``(step, stage)`` pair)."""
        if not isinstance(ref, str):
            step, stage = ref[0], ref[1]
            return check_step(int(step)), check_stage(str(stage))
        local = local_path(ref)
        m = STEP_DIR_RE.match(local.parent.name) if local is not None else None
        if (
            local is None
            or m is None
            or not local.name.endswith(".arrow")
            or local.parent.parent.absolute() != self.root
        ):
            raise StoreError(
                f"{ref!r} is not a stage file of the run folder {self.root} "
                f"(expected {self.root}/step_<n>/<stage>.arrow)"
            )
        return int(m.group(1)), check_stage(local.name[: -len(".arrow")])

    # ------------------------------------------------------------------ write
    def write_stage(
        self,
        step: int,
        stage: str,
        table: pa.Table,
        meta: Mapping[str, Any] | None = None,
        *,
        base: Iterable[str | StageRef] | str | None = None,
    ) -> str:
        """Commit ``table`` as the output of ``stage`` at ``step``; returns its ``file://`` URI.

        ``base``: the stage(s) ``table`` was computed from (URIs or ``(step, stage)``); only what ``table``
        adds to them is written (:mod:`.deltas`). Reading the stage back gives ``table`` whatever the base.
        A crash at any point leaves the stage either committed or absent (:meth:`_commit`).
        """
        what = f"write_stage(step={step}, stage={stage!r})"
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise StoreError(f"{what}: table must be a pyarrow.Table, got {type(table).__name__}")
        clash = [c for c in INTERNAL if c in table.column_names]
        if clash:
            raise StoreError(f"{what}: columns {clash} are the store's own; rename them")
        self._paths(step, stage)  # checks the names
        meta_json = _meta_json(meta, what)
        refs = [self.ref_of(b) for b in ([base] if isinstance(base, str) else base or [])]
        if (step, stage) in refs:
            raise StoreError(f"{what}: a stage cannot be its own base")
        file_table, over = deltas.delta_file_table(table, self._concat_views(refs) if refs else None)
        view = {
            "rows": table.num_rows,
            "schema_hash": schema_hash(table.schema),
            "columns": table.schema.names,
            "view_bytes": int(table.nbytes),
        }
        return self._commit(step, stage, file_table, view, refs if over else [], meta_json, table)

    def write_selection(
        self,
        step: int,
        stage: str,
        positions: Sequence[int] | np.ndarray | pa.Array,
        *,
        base: Iterable[str | StageRef] | str,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        """Commit rows ``positions`` of the concatenated views of ``base`` (in that order) as (step, stage),
        without reading the base's data: only the row ids are read (memory-mapped) and ``_key``/``_src``
        written. Reading it back gives ``concat(base views).take(positions)``."""
        what = f"write_selection(step={step}, stage={stage!r})"
        refs = [self.ref_of(b) for b in ([base] if isinstance(base, str) else base)]
        if not refs:
            raise StoreError(f"{what}: pass at least one base stage")
        mans = [self.manifest(s, n) for s, n in refs]
        idx = pa.array(np.asarray(positions, dtype=np.int64), type=pa.int64())
        same = all(
            m["schema_hash"] == mans[0]["schema_hash"] and m["columns"] == mans[0]["columns"] for m in mans
        )
        src = self._concat_views(refs, False, frozenset({"uid", "sample_idx"}) if same else None)
        if not same:  # bases of different schemas: the rows are assembled and written as a delta
            return self.write_stage(step, stage, src.table.take(idx), meta, base=refs)
        total = sum(int(m["rows"]) for m in mans)
        if len(idx) and (pc.min(idx).as_py() < 0 or pc.max(idx).as_py() >= total):
            raise StoreError(f"{what}: positions must lie in [0, {total}) (the rows of {refs})")
        if src.keys is None:
            raise StoreError(f"{what}: the base rows have no uid/sample_idx")
        meta_json = _meta_json(meta, what)
        view = {
            "rows": len(idx),
            "schema_hash": mans[0]["schema_hash"],
            "columns": list(mans[0]["columns"]),
            "view_bytes": None,
        }
        file_table = deltas.selection_file_table(src.keys, idx)
        return self._commit(step, stage, file_table, view, refs, meta_json, None)

    def _commit(
        self,
        step: int,
        stage: str,
        file_table: pa.Table,
        view: dict[str, Any],
        base: list[StageRef],
        meta_json: Any,
        table: pa.Table | None,
    ) -> str:
        """Write ``file_table``, then the manifest that commits it, then the writer's trust record.

        An older version of the stage is un-committed first (with the stages built on it), so a crash never
        pairs an old manifest with new data.
        """
        data_path, man_path = self._paths(step, stage)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        if man_path.exists():
            self._delete_dependents((step, stage))
            unlink_missing_ok(man_path)
            fsync_dir(data_path.parent)
        file_table, encoded = encode_file_table(file_table)
        written = stage_io.write_file(data_path, file_table)
        man = write_manifest(
            man_path,
            step=step,
            stage=stage,
            view=view,
            file_columns=[c for c in file_table.schema.names if c not in INTERNAL],
            selection=SRC_COLUMN in file_table.column_names,
            encoded=encoded,
            sha256=written.sha256,
            nbytes=written.nbytes,
            meta=meta_json,
            base=base,
        )
        stage_io.record_trust(data_path, written)
        if table is not None:
            self._remember((step, stage, man["sha256"]), deltas.file_view(file_table, table))
        return data_path.as_uri()

    # ------------------------------------------------------------------ manifests
    def manifest(self, step: int, stage: str) -> dict:
        """The committed manifest of a stage (:mod:`.manifests`); raises :class:`StageNotCommitted` if there
        is none."""
        return load_manifest(self._paths(step, stage)[1], step, stage)

    def meta(self, step: int, stage: str) -> dict:
        """The ``meta`` dict given to :meth:`write_stage` for this committed stage."""
        return self.manifest(step, stage).get("meta", {})

    def is_committed(self, step: int, stage: str, _depth: int = 0) -> bool:
        """True when the stage's manifest exists, names a file of the recorded size (no checksum read), and
        every stage it was written over is committed too."""
        try:
            man = self.manifest(step, stage)
        except StoreError:
            return False
        try:
            if (self.step_dir(step) / man["file"]).stat().st_size != man["bytes"]:
                return False
        except FileNotFoundError:
            return False
        if _depth > _MAX_DEPTH:
            return False
        return all(self.is_committed(s, n, _depth + 1) for s, n in base_refs(man))

    def verify_stage(self, step: int, stage: str) -> dict:
        """Check a committed stage's file against its manifest (size + sha256); returns the manifest.

        Raises :class:`StageNotCommitted` or :class:`StoreCorruption` naming the file.
        """
        man = self.manifest(step, stage)
        stage_io.read_file(self.step_dir(step) / man["file"], man, verify=True)
        return man

    # ------------------------------------------------------------------ read
    def _remember(self, key: tuple[int, str, str], view: View) -> None:
        with self._views_lock:
            self._views[key] = view
            self._views.move_to_end(key)
            while len(self._views) > self._VIEW_CACHE_SIZE:
                self._views.popitem(last=False)

    def _view(
        self, step: int, stage: str, verify: bool, columns: frozenset[str] | None = None, _depth: int = 0
    ) -> View:
        """The assembled view of a committed stage (``columns``: only those are needed)."""
        man = self.manifest(step, stage)
        key = (step, stage, man["sha256"])
        if not verify:  # a verified read always checks the files
            with self._views_lock:
                hit = self._views.get(key)
            if hit is not None:
                return hit
        if _depth > _MAX_DEPTH:
            raise StoreCorruption(
                f"stage {stage!r} of step {step}: its base chain is longer than {_MAX_DEPTH} (a cycle?)"
            )
        base = base_refs(man)
        if base and columns is not None and not man["selection"] and not (set(man["file_columns"]) & columns):
            # an aligned delta that adds none of the needed columns: its rows are its base's
            src = self._concat_views(base, verify, columns, _depth + 1)
            names = [c for c in man["columns"] if c in src.table.column_names]
            return View(src.table.select(names), src.keys)
        path = self.step_dir(step) / man["file"]
        file_table = stage_io.read_file(path, man, verify)
        if not base:
            view = deltas.file_view(file_table)
        else:
            need = None if columns is None else columns | {"uid", "sample_idx"}
            src = self._concat_views(base, verify, need, _depth + 1)
            view = deltas.assemble(file_table, src, man, columns, f"stage {stage!r} of step {step} ({path})")
        if columns is None:
            self._remember(key, view)
        return view

    def _concat_views(
        self,
        refs: list[StageRef],
        verify: bool = False,
        columns: frozenset[str] | None = None,
        depth: int = 0,
    ) -> View:
        return deltas.concat_views([self._view(s, n, verify, columns, depth) for s, n in refs])

    def read_stage(
        self, step: int, stage: str, verify: bool = True, columns: Sequence[str] | None = None
    ) -> pa.Table:
        """The table committed as (step, stage), assembled from its delta and its base (checksums verified
        unless ``verify=False``). ``columns``: only these (files that add none of them are not read)."""
        want = None if columns is None else frozenset(columns)
        table = self._view(step, stage, verify, want).table
        if columns is not None:
            missing = [c for c in columns if c not in table.column_names]
            if missing:
                raise StoreError(f"stage {stage!r} of step {step} has no column(s) {missing}")
            table = table.select(list(columns))
        if not verify:
            stage_io.count_mapped(table.nbytes)
        return table

    def read_lengths(self, uri: str | StageRef, columns: Sequence[str]) -> pa.Table:
        """``uid``, ``sample_idx`` and the list lengths of ``columns`` (int32, null rows 0) of a committed
        stage, from memory-mapped files: only the list offsets are touched, never the token values."""
        step, stage = self.ref_of(uri)
        view = self._view(step, stage, False, frozenset(columns) | {"uid", "sample_idx"}).table
        out = pa.table(
            {
                "uid": view.column("uid"),
                "sample_idx": view.column("sample_idx"),
                **{
                    c: pc.fill_null(pc.list_value_length(view.column(c)), 0).cast(pa.int32()) for c in columns
                },
            }
        )
        stage_io.count_mapped(out.nbytes)
        return out

    def read_uri(self, uri: str, verify: bool = True, columns: Sequence[str] | None = None) -> pa.Table:
        """:meth:`read_stage` of the stage whose file is ``uri`` (a ``file://`` URI or a path in this run
        folder)."""
        step, stage = self.ref_of(uri)
        return self.read_stage(step, stage, verify, columns)

    # ------------------------------------------------------------------ listing
    def committed_stages(self, step: int) -> list[str]:
        """Sorted names of the stages committed at ``step``."""
        d = self.step_dir(step)
        if not d.is_dir():
            return []
        names = sorted(
            p.name[: -len(MANIFEST_SUFFIX)]
            for p in d.iterdir()
            if p.name.endswith(MANIFEST_SUFFIX) and not p.name.startswith(".")
        )
        return [s for s in names if STAGE_RE.match(s) and self.is_committed(step, s)]

    def steps(self) -> list[int]:
        """Sorted steps that have a step directory (committed or not)."""
        out = []
        for p in self.root.iterdir():
            m = STEP_DIR_RE.match(p.name)
            if m and p.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def stage_graph(self, steps: Iterable[int] | None = None) -> dict[StageRef, list[StageRef]]:
        """The base refs of every stage with a readable manifest in ``steps`` (default: all steps)."""
        out: dict[StageRef, list[StageRef]] = {}
        for s in self.steps() if steps is None else steps:
            d = self.step_dir(s)
            if not d.is_dir():
                continue
            for p in d.iterdir():
                if not p.name.endswith(MANIFEST_SUFFIX) or p.name.startswith("."):
                    continue
                name = p.name[: -len(MANIFEST_SUFFIX)]
                try:
                    out[(s, name)] = base_refs(json.loads(p.read_bytes()))
                except (ValueError, TypeError, AttributeError, OSError):
                    out[(s, name)] = []
        return out

    # ------------------------------------------------------------------ delete
    def _delete_dependents(self, ref: StageRef) -> None:
        """Delete every stage built (directly or not) on ``ref``, leaves first."""
        graph = self.stage_graph([s for s in self.steps() if s >= ref[0]])
        children: dict[StageRef, list[StageRef]] = {}
        for child, bases in graph.items():
            for b in bases:
                children.setdefault(b, []).append(child)
        seen: set[StageRef] = set()

        def visit(r: StageRef) -> None:
            for c in sorted(children.get(r, [])):
                if c not in seen:
                    seen.add(c)
                    visit(c)
                    self._unlink_stage(*c)

        visit(ref)

    def _unlink_stage(self, step: int, stage: str) -> bool:
        data_path, man_path = self._paths(step, stage)
        existed = man_path.exists() or data_path.exists()
        if man_path.exists():
            unlink_missing_ok(man_path)
            fsync_dir(man_path.parent)
        unlink_missing_ok(data_path)
        unlink_missing_ok(trust.record_path(data_path))
        return existed

    def delete_stage(self, step: int, stage: str) -> bool:
        """Un-commit (manifest first) and delete a stage's files, after deleting the stages built on it
        (leaves first); returns whether the stage was there."""
        self._delete_dependents((step, check_stage(stage)))
        return self._unlink_stage(step, stage)
