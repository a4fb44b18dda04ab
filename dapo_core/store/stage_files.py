"""Stage files of a run: the column-delta, checksummed Arrow files under ``<root>/step_<n>/``.

A stage's output is committed as ``<stage>.arrow`` (Arrow IPC; temp file, fsync, rename) followed by
``<stage>.manifest.json`` (written the same way, then the directory fsynced). **The manifest is the commit**:
a stage is either committed with a file whose sha256 and size match, or it does not exist.

**Column deltas** (manifest ``format`` 2). A stage written with ``base=`` (the URIs or ``(step, stage)`` refs
of the stages it was computed from) stores only what it adds:

- the row key ``_key`` (int64: the first 8 bytes of blake2b over ``uid#sample_idx``; a stable row id);
- ``_src`` (int64) only when its rows are a *selection* of the base rows (filtered, truncated, reordered):
  the position of each row in the concatenation of the base views, in order;
- the columns that are new, or whose values differ from the base's (a column equal to the base's is
  never written again).

The *view* of a stage (what :meth:`StageFiles.read_stage` / :meth:`StageFiles.read_uri` return: the table
that was given to :meth:`StageFiles.write_stage`) is assembled by aligned row order — the base views
concatenated, taken by ``_src`` if present, then the delta's columns attached — with an id check: the
assembled rows' keys must equal the delta's ``_key``, and the view's schema hash must equal the manifest's.
No hash join, and no column is copied on disk. A table without ``uid``/``sample_idx`` columns (update markers,
run-level summaries) is written whole; so is one whose rows are not found in its base.

Consistency: a stage whose base is not committed is not committed either (:meth:`StageFiles.is_committed`);
deleting or re-writing a stage first deletes the stages built on it (leaves first, each manifest before its
file), so a crash at any point leaves every committed stage readable.

**Run-length ends** (manifest ``format`` 3). A per-token list column (``list<int or float>``, no nulls) whose
every row is one value repeated with possibly another last value — ``[b, b, …, b, e]`` — is stored as one
``struct<n: int32, body, last>`` per row and listed in the manifest's ``encoded`` (``{column: "ends"}``); a
read expands it back to the same ``list<…>`` values, bit for bit. GRPO's advantages and returns (one value per
row), the token-level rewards (zeros and the score at the last token) and an all-ones response mask are such
columns: at the recipe's shape they are over half of a step's bytes, and this makes them a few bytes a row.

Manifests of ``format`` 2 (column deltas, before the run-length ends) are read as they are (they have no
``encoded``). Manifests of ``format`` 1 (run folders written before column deltas) have no base and hold whole
tables: they are read as they are, and new stages may be written on top of them (their row keys are computed
on read). A manifest of a newer format than :data:`FORMAT` is refused, naming the file and the fix.

A verified read memory-maps the file and hashes the mapping (no copy into a ``bytes``; the table is then
zero-copy over the checked pages). **Hashed once, across processes** (:mod:`dapo_core.store.trust`): the
writer of a stage file records, in a small trust record beside it, the file's stat identity (device, inode,
size, mtime, ctime) with the sha256 it computed while writing; a reader whose stat of the file equals a
record's identity, and whose manifest names the record's sha256, takes the file on trust. The record counts
only where the identity provably changes with any later write: on a filesystem with fine ctimes (probed once
per process) or, elsewhere, once the file had been unchanged for :data:`.trust.TRUST_AFTER_S` when it was
identified — then the first reader that hashes the file records it for the others. A byte flipped or a file
rewritten through the filesystem is hashed again and refused; bit-rot of the medium after the hash is not
caught — ``DAPO_STORE_VERIFY=always`` (:data:`.trust.VERIFY_ENV`) hashes at every verified read. A worker
reads the generation files of a step in several views (the reward worker scores them, computes the advantage
and the step's metrics; the actor computes old log-probs and updates): none of them hashes them again.

Byte counters (:func:`io_counters`) count the stage-file bytes this process read and wrote, for the
benchmarks that measure what passes through the driver.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import ipc

from dapo_core.errors import DapoUserError
from dapo_core.store import trust
from dapo_core.store.files import atomic_write, atomic_write_bytes, fsync_dir, unlink_missing_ok

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

KEY_COLUMN = "_key"
"""The row id column of every stage file whose table has ``uid`` and ``sample_idx``."""
SRC_COLUMN = "_src"
"""Positions of a selection's rows in the concatenated base views."""
FORMAT = 3
"""Manifest format written now (1: whole tables, no base; 2: column deltas; 3: run-length ends)."""
ENDS = "ends"
"""The ``encoded`` kind of a list column stored as one ``(n, body, last)`` per row (module docstring)."""

StageRef = tuple[int, str]
"""(step, stage) of a stage file in the same run folder."""

_STAGE_RE = re.compile(r"^[a-z0-9_]+$")
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_MANIFEST_SUFFIX = ".manifest.json"
_INTERNAL = (KEY_COLUMN, SRC_COLUMN)
_COUNTERS = {
    "read_bytes": 0,
    "trusted_bytes": 0,
    "mapped_bytes": 0,
    "written_bytes": 0,
    "files_read": 0,
    "files_written": 0,
    "files_hashed": 0,
    "files_trusted": 0,
    "trust_records_written": 0,
}
_COUNTER_LOCK = threading.Lock()
_VERIFIED: OrderedDict[str, tuple[tuple[int, ...], str]] = OrderedDict()
"""path -> (stat identity, sha256) of the files this process verified or trusted (the same rules as a trust
record, :mod:`.trust`): later reads here need not even read the record."""
_VERIFIED_MAX = 4096


class StoreError(DapoUserError, ValueError):
    """A run-store operation was given a bad argument or found the store in an unusable state."""


class StageNotCommitted(StoreError, KeyError):
    """A stage was read that has no committed manifest (it never finished, or it was deleted)."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class StoreCorruption(StoreError):
    """A committed file does not match its manifest (checksum, size or format)."""


# --------------------------------------------------------------------------------------------- helpers
def io_counters(reset: bool = False) -> dict[str, int]:
    """Stage-file bytes and files read and written by this process so far (``reset``: zero them after).

    ``read_bytes``: files read whole and hashed (verified reads); ``trusted_bytes``: files a verified read
    took on trust (hashed before by this process, or named by a trust record — :mod:`.trust` — with the
    file's identity unchanged); ``mapped_bytes``: the columns an unverified read returned from memory-mapped
    files (only those pages are touched); ``written_bytes``: files written; ``files_read`` counts the hashed
    and the trusted files, ``files_hashed`` and ``files_trusted`` each kind (``files_hashed`` counts every
    sha256 of a whole file a read computed, matching or not); ``trust_records_written``: the records this
    process's readers wrote (a writer's records are not counted)."""
    with _COUNTER_LOCK:
        out = dict(_COUNTERS)
        if reset:
            for k in _COUNTERS:
                _COUNTERS[k] = 0
    return out


def _count(kind: str, nbytes: int) -> None:
    with _COUNTER_LOCK:
        _COUNTERS[f"{kind}_bytes"] += int(nbytes)
        if kind != "mapped":
            _COUNTERS["files_read" if kind == "trusted" else f"files_{kind}"] += 1
        if kind == "trusted":
            _COUNTERS["files_trusted"] += 1


def schema_hash(schema: pa.Schema) -> str:
    """A short stable hash of an Arrow schema's field names, types and nullability (metadata ignored)."""
    text = "|".join(f"{f.name}:{f.type}:{int(f.nullable)}" for f in schema)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def row_keys(table: pa.Table) -> pa.Array | None:
    """The row ids of ``table`` (int64, from ``uid`` and ``sample_idx``); None without those columns."""
    if "uid" not in table.column_names or "sample_idx" not in table.column_names:
        return None
    uids = table.column("uid").to_pylist()
    sidx = table.column("sample_idx").to_pylist()
    keys = np.fromiter(
        (
            int.from_bytes(
                hashlib.blake2b(f"{u}#{s}".encode(), digest_size=8).digest(), "little", signed=True
            )
            for u, s in zip(uids, sidx, strict=True)
        ),
        dtype=np.int64,
        count=len(uids),
    )
    return pa.array(keys, type=pa.int64())


def _sha256_mapped(path: Path, expect: str, fine: bool) -> tuple[str, int, pa.Buffer, bool]:
    """Memory-map a whole file; return its sha256, its size, the mapped buffer (hashed in place: no copy) and
    whether it was taken on trust instead of hashed: this process hashed it before, or a trust record (its
    writer's, or another reader's) names ``expect`` for the file's unchanged identity (:mod:`.trust`).
    ``fine``: the file's filesystem gives fine ctimes (:func:`.trust.fine_ctime`)."""
    name = str(path)
    always = trust.verify_always()
    taken_ns = time.time_ns()
    key = trust.stat_key(os.stat(path))
    buf = pa.memory_map(name).read_buffer()
    if not always:
        after = trust.stat_key(os.stat(path))
        if after == key and buf.size == key[2]:
            with _COUNTER_LOCK:
                if _VERIFIED.get(name) == (key, expect):
                    _VERIFIED.move_to_end(name)
                    return expect, buf.size, buf, True
            if trust.trusts(trust.read_record(path), key, expect, fine):
                _remember_verified(name, key, expect)
                return expect, buf.size, buf, True
    digest = hashlib.sha256(memoryview(buf)).hexdigest()
    _count_hash()
    if always or digest != expect or buf.size != key[2]:
        return digest, buf.size, buf, False
    if trust.stat_key(os.stat(path)) == key and trust.trustworthy(key, taken_ns, fine):
        _remember_verified(name, key, digest)
        trust.write_record(path, key, digest, taken_ns, fine, "read")
        _count_record()
    return digest, buf.size, buf, False


def _remember_verified(name: str, key: tuple[int, ...], digest: str) -> None:
    with _COUNTER_LOCK:
        _VERIFIED[name] = (key, digest)
        _VERIFIED.move_to_end(name)
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)


def _count_hash() -> None:
    with _COUNTER_LOCK:
        _COUNTERS["files_hashed"] += 1


def _count_record() -> None:
    with _COUNTER_LOCK:
        _COUNTERS["trust_records_written"] += 1


# ------------------------------------------------------------------------------------- run-length ends
def _ends_type(field: pa.Field) -> pa.DataType | None:
    """The value type of a column that may be stored as run-length ends, or None."""
    t = field.type
    if not pa.types.is_list(t) or t != pa.list_(t.value_type):  # plain list<item> only
        return None
    vt = t.value_type
    if not (pa.types.is_integer(vt) or pa.types.is_floating(vt)):
        return None
    return vt


def _ends_encode_chunk(chunk: pa.ListArray, vt: pa.DataType) -> pa.StructArray | None:
    vals = chunk.flatten()
    if vals.null_count:
        return None
    v = vals.to_numpy(zero_copy_only=False)
    u = v.view(f"u{v.itemsize}")  # compare bits: -0.0 and NaN payloads must come back as they were
    lens = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
    ends = np.cumsum(lens)
    starts = ends - lens
    full = lens > 0
    body = np.zeros(len(lens), dtype=u.dtype)
    last = np.zeros(len(lens), dtype=u.dtype)
    body[full] = u[starts[full]]
    last[full] = u[ends[full] - 1]
    long = lens > 2  # cheap rejection of ordinary columns: the second value of a row must be the first
    if not np.array_equal(u[starts[long] + 1], body[long]):
        return None
    expect = np.repeat(body, lens)
    expect[ends[full] - 1] = last[full]
    if not np.array_equal(expect, u):
        return None
    return pa.StructArray.from_arrays(
        [pa.array(lens.astype(np.int32)), pa.array(body.view(v.dtype), vt), pa.array(last.view(v.dtype), vt)],
        names=["n", "body", "last"],
    )


def _ends_encode(col: pa.ChunkedArray, field: pa.Field) -> tuple[pa.ChunkedArray, pa.Field] | None:
    """``col`` as run-length ends (one ``(n, body, last)`` struct per row) and its file field, or None when
    some row is not ``[b, …, b, e]``, or the column has nulls or another type."""
    vt = _ends_type(field)
    if vt is None or col.null_count:
        return None
    chunks = []
    for chunk in col.chunks:
        enc = _ends_encode_chunk(chunk, vt)
        if enc is None:
            return None
        chunks.append(enc)
    if sum(c.nbytes for c in chunks) >= col.nbytes:  # rows of 0-2 values: nothing to gain
        return None
    stype = pa.struct([("n", pa.int32()), ("body", vt), ("last", vt)])
    return (
        pa.chunked_array(chunks, type=stype),
        pa.field(field.name, stype, nullable=field.nullable, metadata=field.metadata),
    )


def _ends_decode(col: pa.ChunkedArray, field: pa.Field, where: Path) -> tuple[pa.ChunkedArray, pa.Field]:
    """The ``list<…>`` column that :func:`_ends_encode` stored as ``col``."""
    t = field.type
    if not (
        pa.types.is_struct(t) and [f.name for f in t] == ["n", "body", "last"] and t[1].type == t[2].type
    ):
        raise StoreCorruption(f"{where}: column {field.name!r} is marked run-length encoded but has type {t}")
    vt = t[1].type
    chunks = []
    for chunk in col.chunks:
        lens = pc.struct_field(chunk, "n").to_numpy(zero_copy_only=False).astype(np.int64)
        body = pc.struct_field(chunk, "body").to_numpy(zero_copy_only=False)
        last = pc.struct_field(chunk, "last").to_numpy(zero_copy_only=False)
        if len(lens) and lens.min() < 0:
            raise StoreCorruption(f"{where}: column {field.name!r} has a negative run length")
        ends = np.cumsum(lens)
        vals = np.repeat(body, lens)
        full = lens > 0
        vals[ends[full] - 1] = last[full]
        offsets = np.concatenate([[0], ends]).astype(np.int32)
        chunks.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(vals, vt), type=pa.list_(vt)))
    return (
        pa.chunked_array(chunks, type=pa.list_(vt)),
        pa.field(field.name, pa.list_(vt), nullable=field.nullable, metadata=field.metadata),
    )


def _encode_file_table(file_table: pa.Table) -> tuple[pa.Table, dict[str, str]]:
    """``file_table`` with every column that can be stored as run-length ends so stored, and the manifest's
    ``encoded``."""
    encoded: dict[str, str] = {}
    cols, fields = [], []
    for field in file_table.schema:
        col = file_table.column(field.name)
        enc = None if field.name in _INTERNAL else _ends_encode(col, field)
        if enc is not None:
            col, field = enc
            encoded[field.name] = ENDS
        cols.append(col)
        fields.append(field)
    if not encoded:
        return file_table, encoded
    return pa.Table.from_arrays(cols, schema=pa.schema(fields, metadata=file_table.schema.metadata)), encoded


def _decode_file_table(table: pa.Table, man: dict, path: Path) -> pa.Table:
    """The file table as written, with the manifest's ``encoded`` columns expanded back."""
    encoded = man.get("encoded") or {}
    if not encoded:
        return table
    if not isinstance(encoded, dict):
        raise StoreCorruption(f"{path}: its manifest's 'encoded' is not a mapping")
    cols, fields = [], []
    for field in table.schema:
        col = table.column(field.name)
        kind = encoded.get(field.name)
        if kind == ENDS:
            col, field = _ends_decode(col, field, path)
        elif kind is not None:
            raise StoreCorruption(f"{path}: column {field.name!r} has an unknown encoding {kind!r}")
        cols.append(col)
        fields.append(field)
    return pa.Table.from_arrays(cols, schema=pa.schema(fields, metadata=table.schema.metadata))


_HASHER: ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()
_OVERLAP_MIN = 1 << 20
"""Buffers at least this large are hashed on a helper thread while the same buffer is written."""


def _hasher() -> ThreadPoolExecutor:
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dapo-store-sha256")
        return _HASHER


class _HashingSink:
    """A minimal writable file object that hashes and counts everything written to the real file.

    A large buffer is hashed on a helper thread while the calling thread writes it (both release the GIL),
    and the write returns only when both are done: the hash is still of exactly the bytes written, in order,
    and the buffer is not used after the call."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0
        self.closed = False

    def write(self, data) -> int:
        mv = memoryview(data)
        if mv.nbytes < _OVERLAP_MIN:
            self.sha.update(mv)
            self._f.write(mv)
        else:
            hashed = _hasher().submit(self.sha.update, mv)
            try:
                self._f.write(mv)
            finally:
                hashed.result()
        self.nbytes += mv.nbytes
        return mv.nbytes

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:  # the caller owns the underlying file
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.nbytes


def _local_path_from_uri(uri: str) -> Path | None:
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    if "://" not in uri:
        return Path(uri)
    return None


def _check_stage(stage: str) -> str:
    if not isinstance(stage, str) or not _STAGE_RE.match(stage):
        raise StoreError(
            f"stage name {stage!r} is invalid: use lowercase letters, digits and '_' only "
            f"(e.g. 'generate_g0', 'old_log_prob')"
        )
    return stage


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StoreError(f"step {step!r} is invalid: pass a non-negative int")
    return step


def _concat(tables: list[pa.Table]) -> pa.Table:
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


def _concat_keys(keys: list[pa.Array | pa.ChunkedArray]) -> pa.ChunkedArray:
    chunks: list[pa.Array] = []
    for k in keys:
        chunks.extend(k.chunks if isinstance(k, pa.ChunkedArray) else [k])
    return pa.chunked_array(chunks, type=pa.int64())


class _View:
    """An assembled stage view and its row keys (None: not computed yet, for whole-table files)."""

    __slots__ = ("_keys", "table")

    def __init__(self, table: pa.Table, keys: pa.Array | pa.ChunkedArray | None):
        self.table = table
        self._keys = keys

    @property
    def keys(self) -> pa.ChunkedArray | None:
        if self._keys is None:
            self._keys = row_keys(self.table)
        if self._keys is None:
            return None
        return _concat_keys([self._keys])


# --------------------------------------------------------------------------------------------- stage files
class StageFiles:
    """The stage files of the run folder ``root`` (no ledger: safe to open in any worker process).

    Workers open one from the run's root to read their inputs and commit their outputs themselves; the
    driver's :class:`~dapo_core.store.run_store.RunStore` is a ``StageFiles`` plus the ledger and run files.
    Pickling re-opens it from its root on the other side.
    """

    _VIEW_CACHE_SIZE = 2
    """Views kept in memory after a write or read, for unverified reads (a writer compares its table with its
    base without re-reading it: a job's input and its output); a verified read always reads and checks the
    files. Small, since at the recipe's shape one view is a few GB."""

    def __init__(self, root: str | Path):
        local = _local_path_from_uri(str(root))
        if local is None:
            raise StoreError(
                f"store root {root!r} must be a local path or file:// URL (commits need fsync and atomic "
                f"rename; a shared filesystem mounted at the same path on every node is fine)"
            )
        self.root = local.absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self._views: OrderedDict[tuple[int, str, str], _View] = OrderedDict()
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
        return self.root / f"step_{_check_step(step):06d}"

    def _paths(self, step: int, stage: str) -> tuple[Path, Path]:
        d = self.step_dir(step)
        _check_stage(stage)
        return d / f"{stage}.arrow", d / f"{stage}{_MANIFEST_SUFFIX}"

    def stage_uri(self, step: int, stage: str) -> str:
        """The ``file://`` URI of a stage's Arrow file (whether or not it is committed)."""
        return self._paths(step, stage)[0].as_uri()

    def ref_of(self, ref: str | StageRef | Sequence[Any]) -> StageRef:
        """``(step, stage)`` of a stage URI of this run folder (or of a ``(step, stage)`` pair)."""
        if not isinstance(ref, str):
            step, stage = ref[0], ref[1]
            return _check_step(int(step)), _check_stage(str(stage))
        local = _local_path_from_uri(ref)
        m = _STEP_DIR_RE.match(local.parent.name) if local is not None else None
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
        return int(m.group(1)), _check_stage(local.name[: -len(".arrow")])

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
        adds to them is written (module docstring). Reading the stage back gives ``table`` whatever the base.

        Order: (un-commit an older version and the stages built on it) → data to temp file + fsync + rename →
        manifest to temp file + fsync + rename + dir fsync. A crash at any point leaves the stage either
        committed or absent.
        """
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise StoreError(
                f"write_stage(step={step}, stage={stage!r}): table must be a pyarrow.Table, "
                f"got {type(table).__name__}"
            )
        clash = [c for c in _INTERNAL if c in table.column_names]
        if clash:
            raise StoreError(
                f"write_stage(step={step}, stage={stage!r}): columns {clash} are the store's own; rename them"
            )
        self._paths(step, stage)  # checks the names
        meta = dict(meta or {})
        try:
            meta_json = json.loads(json.dumps(meta, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise StoreError(
                f"write_stage(step={step}, stage={stage!r}): meta is not JSON-serialisable ({e})"
            ) from None
        if isinstance(base, str):
            base = [base]
        refs = [self.ref_of(b) for b in (base or [])]
        if (step, stage) in refs:
            raise StoreError(f"write_stage(step={step}, stage={stage!r}): a stage cannot be its own base")
        file_table, base_json = self._delta(table, refs)
        view = {
            "rows": table.num_rows,
            "schema_hash": schema_hash(table.schema),
            "columns": table.schema.names,
            "view_bytes": int(table.nbytes),
        }
        return self._commit(step, stage, file_table, view, base_json, meta_json, table)

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
        if isinstance(base, str):
            base = [base]
        refs = [self.ref_of(b) for b in base]
        if not refs:
            raise StoreError(f"write_selection(step={step}, stage={stage!r}): pass at least one base stage")
        mans = [self.manifest(s, n) for s, n in refs]
        idx = pa.array(np.asarray(positions, dtype=np.int64), type=pa.int64())
        same = all(m.get("schema_hash") == mans[0].get("schema_hash") for m in mans) and all(
            m.get("columns") == mans[0].get("columns") for m in mans
        )
        src = self._concat_views(refs, False, None if not same else frozenset({"uid", "sample_idx"}))
        if not same:  # bases of different schemas: the rows are assembled and written as a delta
            return self.write_stage(step, stage, src.table.take(idx), meta, base=refs)
        total = sum(int(m["rows"]) for m in mans)
        if len(idx) and (pc.min(idx).as_py() < 0 or pc.max(idx).as_py() >= total):
            raise StoreError(
                f"write_selection(step={step}, stage={stage!r}): positions must lie in [0, {total}) "
                f"(the rows of {refs})"
            )
        keys = src.keys
        if keys is None:
            raise StoreError(
                f"write_selection(step={step}, stage={stage!r}): the base rows have no uid/sample_idx"
            )
        try:
            meta_json = json.loads(json.dumps(dict(meta or {}), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise StoreError(
                f"write_selection(step={step}, stage={stage!r}): meta is not JSON ({e})"
            ) from None
        file_table = pa.Table.from_arrays(
            [keys.take(idx), idx],
            schema=pa.schema(
                [
                    pa.field(KEY_COLUMN, pa.int64(), nullable=False),
                    pa.field(SRC_COLUMN, pa.int64(), nullable=False),
                ]
            ),
        )
        view = {
            "rows": len(idx),
            "schema_hash": mans[0].get("schema_hash"),
            "columns": list(mans[0].get("columns", [])),
            "view_bytes": None,
        }
        return self._commit(step, stage, file_table, view, [list(r) for r in refs], meta_json, None)

    def _commit(
        self,
        step: int,
        stage: str,
        file_table: pa.Table,
        view: dict[str, Any],
        base_json: list[list],
        meta_json: Any,
        table: pa.Table | None,
    ) -> str:
        """Write ``file_table`` and then the manifest that commits it (see :meth:`write_stage`)."""
        data_path, man_path = self._paths(step, stage)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        if man_path.exists():  # un-commit first so a crash mid-rewrite never pairs old manifest + new data
            self._delete_dependents((step, stage))
            unlink_missing_ok(man_path)
            fsync_dir(data_path.parent)
        file_table, encoded = _encode_file_table(file_table)
        sinks: list[_HashingSink] = []

        def write_ipc(f: BinaryIO) -> None:
            sinks.append(_HashingSink(f))
            with ipc.new_file(sinks[-1], file_table.schema) as writer:
                writer.write_table(file_table)

        atomic_write(data_path, write_ipc, fsync_parent=False)  # the manifest's write syncs the directory
        taken_ns = time.time_ns()
        written_key = trust.stat_key(os.stat(data_path))  # after the rename: the committed file's identity
        sink = sinks[-1]
        _count("written", sink.nbytes)
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "step": step,
            "stage": stage,
            "file": data_path.name,
            **view,
            "file_columns": [c for c in file_table.schema.names if c not in _INTERNAL],
            "selection": SRC_COLUMN in file_table.column_names,
            "encoded": encoded,
            "sha256": sink.sha.hexdigest(),
            "bytes": sink.nbytes,
            "meta": meta_json,
            "created": time.time(),
        }
        if base_json:
            manifest["base"] = base_json
        atomic_write_bytes(man_path, json.dumps(manifest, sort_keys=True, indent=1).encode())
        fine = trust.fine_ctime(data_path.parent)
        if trust.trustworthy(written_key, taken_ns, fine) and written_key[2] == sink.nbytes:
            trust.write_record(data_path, written_key, manifest["sha256"], taken_ns, fine, "write")
        if table is not None:
            self._remember((step, stage, manifest["sha256"]), _View(table, _key_array(file_table)))
        return data_path.as_uri()

    def _delta(self, table: pa.Table, refs: list[StageRef]) -> tuple[pa.Table, list[list]]:
        """The file table of ``table`` over base ``refs`` (and the manifest's ``base``), or the whole table
        with its keys when it cannot be expressed over them."""
        keys = None
        if refs:
            src = self._concat_views(refs)
            src_keys = src.keys
            if src_keys is not None and "uid" in table.column_names and "sample_idx" in table.column_names:
                aligned = (
                    table.num_rows == src.table.num_rows
                    and "uid" in src.table.column_names
                    and table.column("uid").equals(src.table.column("uid"))
                    and table.column("sample_idx").equals(src.table.column("sample_idx"))
                )
                if aligned:
                    keys, idx, base_rows = src_keys, None, src.table
                else:
                    keys = row_keys(table)
                    assert keys is not None
                    pos = pc.index_in(keys, value_set=src_keys)
                    if pos.null_count == 0:
                        idx = pos.cast(pa.int64())
                        base_rows = src.table.take(idx)
                    else:
                        base_rows = None
                if base_rows is not None:
                    cols, names = [pa.chunked_array(_concat_keys([keys]))], [KEY_COLUMN]
                    if idx is not None:
                        cols.append(pa.chunked_array([idx]))
                        names.append(SRC_COLUMN)
                    for f in table.schema:
                        col = table.column(f.name)
                        same = (
                            f.name in base_rows.column_names
                            and base_rows.schema.field(f.name).type == f.type
                            and base_rows.schema.field(f.name).nullable == f.nullable
                            and col.equals(base_rows.column(f.name))
                        )
                        if not same:
                            cols.append(col)
                            names.append(f.name)
                    fields = [pa.field(KEY_COLUMN, pa.int64(), nullable=False)]
                    if idx is not None:
                        fields.append(pa.field(SRC_COLUMN, pa.int64(), nullable=False))
                    fields += [table.schema.field(n) for n in names[len(fields) :]]
                    return pa.Table.from_arrays(cols, schema=pa.schema(fields)), [list(r) for r in refs]
        keys = row_keys(table)
        if keys is None:
            return table, []
        return table.add_column(0, pa.field(KEY_COLUMN, pa.int64(), nullable=False), keys), []

    # ------------------------------------------------------------------ manifests
    def manifest(self, step: int, stage: str) -> dict:
        """The committed manifest of a stage; raises :class:`StageNotCommitted` if there is none."""
        _, man_path = self._paths(step, stage)
        try:
            text = man_path.read_bytes()
        except FileNotFoundError:
            raise StageNotCommitted(
                f"stage {stage!r} of step {step} is not committed (no {man_path.name} in "
                f"{man_path.parent}): run the stage first"
            ) from None
        try:
            man = json.loads(text)
            if not all(k in man for k in ("sha256", "bytes", "file")):
                raise KeyError("sha256/bytes/file")
        except (ValueError, KeyError, TypeError):
            raise StoreCorruption(
                f"manifest {man_path} is unreadable: delete_stage({step}, {stage!r}) and re-run the stage"
            ) from None
        if int(man.get("format", 1)) > FORMAT:
            raise StoreError(
                f"{man_path} has manifest format {man['format']}, newer than this code reads ({FORMAT}): "
                f"the run folder was written by a newer dapo",
                fix="upgrade this checkout to the version that wrote the run, or start a new run",
            )
        return man

    def meta(self, step: int, stage: str) -> dict:
        """The ``meta`` dict given to :meth:`write_stage` for this committed stage."""
        return self.manifest(step, stage).get("meta", {})

    def base_of(self, step: int, stage: str) -> list[StageRef]:
        """The ``(step, stage)`` refs a committed stage was written over (empty: a whole table)."""
        return [(int(s), str(n)) for s, n in self.manifest(step, stage).get("base", [])]

    def is_committed(self, step: int, stage: str, _depth: int = 0) -> bool:
        """True when the stage's manifest exists, names a file of the recorded size (no checksum read), and
        every stage it was written over is committed too."""
        try:
            man = self.manifest(step, stage)
        except StoreError:
            return False
        data = self.step_dir(step) / man["file"]
        try:
            if data.stat().st_size != man["bytes"]:
                return False
        except FileNotFoundError:
            return False
        if _depth > 64:
            return False
        return all(self.is_committed(int(s), str(n), _depth + 1) for s, n in man.get("base", []))

    def verify_stage(self, step: int, stage: str) -> dict:
        """Check a committed stage's file against its manifest (size + sha256); returns the manifest.

        Raises :class:`StageNotCommitted` or :class:`StoreCorruption` naming the file.
        """
        man = self.manifest(step, stage)
        self._read_verified(self.step_dir(step) / man["file"], man, verify=True)
        return man

    # ------------------------------------------------------------------ read
    def _read_verified(self, path: Path, man: dict, verify: bool) -> pa.Table:
        try:
            data: pa.Buffer | pa.MemoryMappedFile
            if verify:  # mapped and hashed in place; the table is zero-copy over the checked pages
                digest, size, data, trusted = _sha256_mapped(
                    path, str(man["sha256"]), trust.fine_ctime(path.parent)
                )
                _count("trusted" if trusted else "read", size)
            else:  # memory-mapped: only the pages of the columns used are ever read
                data = pa.memory_map(str(path))
                digest, size = None, data.size()
        except FileNotFoundError:
            raise StoreCorruption(
                f"{path} is missing although its manifest commits it: delete the stage and re-run it"
            ) from None
        if size != man["bytes"]:
            raise StoreCorruption(
                f"{path} has {size} bytes, its manifest says {man['bytes']} (torn or truncated "
                f"file): delete the stage and re-run it"
            )
        if digest is not None and digest != man["sha256"]:
            raise StoreCorruption(
                f"{path} fails its sha256 check (manifest {man['sha256'][:12]}…, file "
                f"{digest[:12]}…): the file is corrupted; delete the stage and re-run it"
            )
        try:
            table = ipc.open_file(data).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreCorruption(f"{path} is not a readable Arrow IPC file ({e})") from None
        if table.num_rows != man.get("rows", table.num_rows):
            raise StoreCorruption(f"{path} has {table.num_rows} rows, its manifest says {man['rows']}")
        return _decode_file_table(table, man, path)

    def _remember(self, key: tuple[int, str, str], view: _View) -> None:
        with self._views_lock:
            self._views[key] = view
            self._views.move_to_end(key)
            while len(self._views) > self._VIEW_CACHE_SIZE:
                self._views.popitem(last=False)

    def _view(
        self,
        step: int,
        stage: str,
        verify: bool,
        columns: frozenset[str] | None = None,
        _depth: int = 0,
    ) -> _View:
        """The assembled view of a committed stage (``columns``: only those are needed)."""
        man = self.manifest(step, stage)
        key = (step, stage, man["sha256"])
        if not verify:  # a verified read always checks the files
            with self._views_lock:
                hit = self._views.get(key)
            if hit is not None:
                return hit
        if _depth > 64:
            raise StoreCorruption(
                f"stage {stage!r} of step {step}: its base chain is longer than 64 (a cycle?)"
            )
        base = [(int(s), str(n)) for s, n in man.get("base", [])]
        file_cols = set(man.get("file_columns", []))
        if base and columns is not None and not man.get("selection") and not (file_cols & columns):
            # an aligned delta that adds none of the needed columns: its rows are its base's
            view = self._concat_views(base, verify, columns, _depth + 1)
            names = [c for c in man["columns"] if c in view.table.column_names]
            return _View(view.table.select(names), view._keys)
        path = self.step_dir(step) / man["file"]
        ft = self._read_verified(path, man, verify)
        if not base:
            keys = ft.column(KEY_COLUMN) if KEY_COLUMN in ft.column_names else None
            view = _View(ft.drop_columns([KEY_COLUMN]) if keys is not None else ft, keys)
        else:
            view = self._assemble(step, stage, man, ft, base, verify, columns, _depth)
        if columns is None:
            self._remember(key, view)
        return view

    def _assemble(
        self,
        step: int,
        stage: str,
        man: dict,
        ft: pa.Table,
        base: list[StageRef],
        verify: bool,
        columns: frozenset[str] | None,
        depth: int,
    ) -> _View:
        need = None if columns is None else columns | {"uid", "sample_idx"}
        src = self._concat_views(base, verify, need, depth + 1)
        table, keys = src.table, src.keys
        where = f"stage {stage!r} of step {step} ({self.step_dir(step) / man['file']})"
        if keys is None:
            raise StoreCorruption(f"{where}: its base has no uid/sample_idx row ids")
        if SRC_COLUMN in ft.column_names:
            idx = ft.column(SRC_COLUMN)
            if table.num_rows and pc.max(idx).as_py() is not None and pc.max(idx).as_py() >= table.num_rows:
                raise StoreCorruption(f"{where}: selects rows beyond its base's {table.num_rows}")
            run = _contiguous(idx)
            if run is None:
                table, keys = table.take(idx), keys.take(idx)
            else:  # rows a..a+k in order (the whole base, or a prefix): a zero-copy slice, no take
                table, keys = table.slice(*run), keys.slice(*run)
        if not keys.equals(_concat_keys([ft.column(KEY_COLUMN)])):
            raise StoreCorruption(
                f"{where}: its row ids do not match the rows of its base {base} (the base was rewritten "
                f"without it): delete the stage and re-run it"
            )
        cols, fields = [], []
        for name in man["columns"]:
            if columns is not None and name not in columns:
                continue
            if name in ft.column_names:
                cols.append(ft.column(name))
                fields.append(ft.schema.field(name))
            elif name in table.column_names:
                cols.append(table.column(name))
                fields.append(table.schema.field(name))
            else:
                raise StoreCorruption(f"{where}: column {name!r} is neither in the file nor in its base")
        view = pa.Table.from_arrays(cols, schema=pa.schema(fields))
        if columns is None and schema_hash(view.schema) != man.get("schema_hash"):
            raise StoreCorruption(f"{where}: the assembled schema does not match the manifest's")
        return _View(view, ft.column(KEY_COLUMN))

    def _concat_views(
        self,
        refs: list[StageRef],
        verify: bool = False,
        columns: frozenset[str] | None = None,
        depth: int = 0,
    ) -> _View:
        views = [self._view(s, n, verify, columns, depth) for s, n in refs]
        if len(views) == 1:
            return views[0]
        keys = [v.keys for v in views]
        table = _concat([v.table for v in views])
        return _View(table, None if any(k is None for k in keys) else _concat_keys(keys))

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
            _count("mapped", table.nbytes)
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
        _count("mapped", out.nbytes)
        return out

    def read_uri(self, uri: str, verify: bool = True, columns: Sequence[str] | None = None) -> pa.Table:
        """Read an Arrow IPC file by URI (``file://`` or any fsspec URL).

        A stage file of this run folder is read as :meth:`read_stage` (its view, verified). Another file with
        a manifest beside it has its size and checksum verified; a stage file whose manifest is missing is
        refused (it is not committed).
        """
        local = _local_path_from_uri(uri)
        if local is not None:
            name = local.name
            if name.endswith(".arrow"):
                man_path = local.with_name(name[: -len(".arrow")] + _MANIFEST_SUFFIX)
                in_run = _STEP_DIR_RE.match(local.parent.name) and local.parent.parent.absolute() == self.root
                if in_run and man_path.exists():
                    step, stage = self.ref_of(uri)
                    return self.read_stage(step, stage, verify, columns)
                if man_path.exists():
                    try:
                        man = json.loads(man_path.read_bytes())
                    except ValueError:
                        raise StoreCorruption(f"manifest {man_path} is unreadable") from None
                    if man.get("base"):
                        return StageFiles(local.parent.parent).read_uri(uri, verify, columns)
                    t = self._read_verified(local, man, verify)
                    t = t.drop_columns([KEY_COLUMN]) if KEY_COLUMN in t.column_names else t
                    return t.select(list(columns)) if columns is not None else t
                if _STEP_DIR_RE.match(local.parent.name):
                    raise StageNotCommitted(f"{uri} is not committed (no {man_path.name} beside it)")
            try:
                with open(local, "rb") as f:
                    t = ipc.open_file(pa.py_buffer(f.read())).read_all()
            except FileNotFoundError:
                raise StoreError(f"read_uri: {uri} does not exist") from None
            return t.select(list(columns)) if columns is not None else t
        with fsspec.open(uri, "rb") as f:
            t = ipc.open_file(pa.py_buffer(f.read())).read_all()
        return t.select(list(columns)) if columns is not None else t

    # ------------------------------------------------------------------ listing
    def committed_stages(self, step: int) -> list[str]:
        """Sorted names of the stages committed at ``step``."""
        d = self.step_dir(step)
        if not d.is_dir():
            return []
        names = sorted(
            p.name[: -len(_MANIFEST_SUFFIX)]
            for p in d.iterdir()
            if p.name.endswith(_MANIFEST_SUFFIX) and not p.name.startswith(".")
        )
        return [s for s in names if _STAGE_RE.match(s) and self.is_committed(step, s)]

    def steps(self) -> list[int]:
        """Sorted steps that have a step directory (committed or not)."""
        out = []
        for p in self.root.iterdir():
            m = _STEP_DIR_RE.match(p.name)
            if m and p.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_committed_step(self, stage: str) -> int | None:
        """The highest step at which ``stage`` is committed, or None."""
        _check_stage(stage)
        for step in reversed(self.steps()):
            if self.is_committed(step, stage):
                return step
        return None

    def stage_graph(self, steps: Iterable[int] | None = None) -> dict[StageRef, list[StageRef]]:
        """The base refs of every stage with a readable manifest in ``steps`` (default: all steps)."""
        out: dict[StageRef, list[StageRef]] = {}
        for s in self.steps() if steps is None else steps:
            d = self.step_dir(s)
            if not d.is_dir():
                continue
            for p in d.iterdir():
                if not p.name.endswith(_MANIFEST_SUFFIX) or p.name.startswith("."):
                    continue
                name = p.name[: -len(_MANIFEST_SUFFIX)]
                try:
                    out[(s, name)] = [(int(a), str(b)) for a, b in json.loads(p.read_bytes()).get("base", [])]
                except (ValueError, TypeError, OSError):
                    out[(s, name)] = []
        return out

    # ------------------------------------------------------------------ delete
    def _delete_dependents(self, ref: StageRef) -> list[StageRef]:
        """Delete every stage built (directly or not) on ``ref``, leaves first; returns them."""
        graph = self.stage_graph([s for s in self.steps() if s >= ref[0]])
        children: dict[StageRef, list[StageRef]] = {}
        for child, bases in graph.items():
            for b in bases:
                children.setdefault(b, []).append(child)
        done: list[StageRef] = []
        seen: set[StageRef] = set()

        def visit(r: StageRef) -> None:
            for c in sorted(children.get(r, [])):
                if c not in seen:
                    seen.add(c)
                    visit(c)
                    self._unlink_stage(*c)
                    done.append(c)

        visit(ref)
        return done

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
        self._delete_dependents((step, _check_stage(stage)))
        return self._unlink_stage(step, stage)

    def clean_temp_files(self, min_age_s: float = 60.0) -> int:
        """Remove temp files (``.*.tmp-*``) left by crashed writers that are older than ``min_age_s``."""
        now, n = time.time(), 0
        dirs = [self.root] + [self.step_dir(s) for s in self.steps()]
        for d in dirs:
            for p in d.iterdir():
                if p.name.startswith(".") and ".tmp-" in p.name and p.is_file():
                    try:
                        if now - p.stat().st_mtime >= min_age_s:
                            p.unlink()
                            n += 1
                    except FileNotFoundError:
                        pass
        return n


def _contiguous(idx: pa.ChunkedArray | pa.Array) -> tuple[int, int] | None:
    """``(start, length)`` when the positions ``idx`` are ``start, start + 1, …`` (else None)."""
    pos = np.concatenate(
        [
            c.to_numpy(zero_copy_only=False)
            for c in (idx.chunks if isinstance(idx, pa.ChunkedArray) else [idx])
        ]
        or [np.zeros(0, np.int64)]
    )
    if not len(pos) or pos[0] < 0 or not np.array_equal(pos, np.arange(pos[0], pos[0] + len(pos))):
        return None
    return int(pos[0]), len(pos)


def _key_array(file_table: pa.Table) -> pa.ChunkedArray | None:
    return file_table.column(KEY_COLUMN) if KEY_COLUMN in file_table.column_names else None
