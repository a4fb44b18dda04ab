"""The run store: the durable transfer queue and single source of truth of a run.

A run lives in one directory, ``runs/<run_id>/``:

- ``ledger.sqlite`` — the prompt/trajectory ledger (SQLite, WAL, ``synchronous=FULL``). Every key carries a
  JSON tag dict; the tags ``status``, ``is_prompt``, ``global_steps`` and the key's ``partition`` are mirrored
  into indexed columns so the queries the trainer runs every step stay fast. A key may also carry a small
  payload (bytes, e.g. the prompt row as Arrow IPC, so a prompt can be re-issued after a crash).
  Prompt keys are ``{uid}``; trajectory keys are ``{uid}_{anything}``, so ``uid`` may not contain ``_``.
- ``step_000042/<stage>.arrow`` — a stage's output (Arrow IPC file), written to a temp file, fsynced and
  renamed; then ``<stage>.manifest.json`` (rows, schema hash, sha256, bytes, meta) is written the same way
  and the directory fsynced. **The manifest is the commit**: a stage is either committed with a file whose
  checksum matches, or it does not exist. Re-writing a committed stage first removes its manifest.
- ``*.json`` run-level files (resolved config, run state), written atomically.
- ``ckpt/`` — checkpoints, managed by :class:`dapo_core.store.checkpoint.CheckpointDir` (see
  :attr:`RunStore.checkpoints`).

The ledger has one writer (the flow's driver); stage files may be written by any process that can reach
the directory. Local paths use a direct fast path (fsync needs a local file); ``read_uri`` accepts any
fsspec URL.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal, Self

import fsspec
import pyarrow as pa
from pyarrow import ipc

from dapo_core.errors import DapoUserError
from dapo_core.store.checkpoint import CheckpointDir
from dapo_core.store.files import DiskFull, atomic_write, atomic_write_bytes, fsync_dir, unlink_missing_ok

__all__ = [
    "INFLIGHT_STATUSES",
    "PROMPT_STATUSES",
    "RunStore",
    "StageNotCommitted",
    "StoreCorruption",
    "StoreError",
    "atomic_write_bytes",
    "fsync_dir",
    "schema_hash",
]

PROMPT_STATUSES = ("pending", "running", "finished", "failure")
"""Allowed values of the ``status`` tag of a prompt key."""
INFLIGHT_STATUSES = ("pending", "running")
"""Statuses of a prompt whose group is not settled yet (re-issued after a crash)."""

_STAGE_RE = re.compile(r"^[a-z0-9_]+$")
_TAG_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_INDEXED = ("status", "is_prompt", "global_steps")
_MANIFEST_SUFFIX = ".manifest.json"
_CHUNK = 8 << 20


class StoreError(DapoUserError, ValueError):
    """A run-store operation was given a bad argument or found the store in an unusable state."""


class StageNotCommitted(StoreError, KeyError):
    """A stage was read that has no committed manifest (it never finished, or it was deleted)."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class StoreCorruption(StoreError):
    """A committed file does not match its manifest (checksum, size or format)."""


# --------------------------------------------------------------------------------------------- helpers
def schema_hash(schema: pa.Schema) -> str:
    """A short stable hash of an Arrow schema's field names, types and nullability (metadata ignored)."""
    text = "|".join(f"{f.name}:{f.type}:{int(f.nullable)}" for f in schema)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _sha256_file(path: Path) -> tuple[str, int, bytes]:
    """Read a whole file; return its sha256, its size and the bytes."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha256(data).hexdigest(), len(data), data


class _HashingSink:
    """A minimal writable file object that hashes and counts everything written to the real file."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0
        self.closed = False

    def write(self, data) -> int:
        mv = memoryview(data)
        self.sha.update(mv)
        self._f.write(mv)
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


def _check_tag_names(tags: Mapping[str, Any]) -> None:
    for name in tags:
        if not isinstance(name, str) or not _TAG_RE.match(name):
            raise StoreError(f"tag name {name!r} is invalid: use an identifier ([A-Za-z_][A-Za-z0-9_]*)")


def _uid_of(key: str, is_prompt: bool) -> str:
    if not isinstance(key, str) or not key:
        raise StoreError(f"ledger key {key!r} is invalid: pass a non-empty str")
    if is_prompt:
        if "_" in key:
            raise StoreError(
                f"prompt key {key!r} contains '_': a uid must not contain '_' "
                f"(trajectory keys are '{{uid}}_{{sample}}'); use uuid4().hex"
            )
        return key
    uid, sep, rest = key.partition("_")
    if not sep or not uid or not rest:
        raise StoreError(
            f"trajectory key {key!r} must look like '{{uid}}_{{sample}}' (uid without '_'), "
            f"or tag it is_prompt=True if it is a prompt"
        )
    return uid


def _columns(tags: Mapping[str, Any]) -> tuple[str | None, int, int | None]:
    status = tags.get("status")
    if status is not None and not isinstance(status, str):
        raise StoreError(f"tag 'status' must be a str, got {status!r}")
    if tags.get("is_prompt") and status is not None and status not in PROMPT_STATUSES:
        raise StoreError(f"prompt status {status!r} is invalid: use one of {PROMPT_STATUSES}")
    gs = tags.get("global_steps")
    if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int)):
        raise StoreError(f"tag 'global_steps' must be an int, got {gs!r}")
    return status, int(bool(tags.get("is_prompt", False))), gs


def _sql_value(v: Any) -> Any:
    """Value as SQLite compares it with json_extract (bools are stored as JSON true/false → 1/0)."""
    if isinstance(v, bool):
        return int(v)
    return v


# --------------------------------------------------------------------------------------------- store
class RunStore:
    """The durable store of one run (ledger + committed stage outputs + run files + checkpoints).

    ``RunStore(root)`` creates ``root`` if needed and opens (or creates) ``root/ledger.sqlite``. A missing
    ledger in a folder that already holds steps or checkpoints is refused (:class:`StoreError`): creating
    an empty one would continue the run with its history gone.
    It is safe to share one instance between threads (a lock serialises ledger access). Pickling a
    store re-opens it from its root on the other side.
    """

    def __init__(self, root: str | Path):
        local = _local_path_from_uri(str(root))
        if local is None:
            raise StoreError(
                f"RunStore root {root!r} must be a local path or file:// URL (the ledger is SQLite "
                f"and commits need fsync); put remote payloads on fsspec URLs and read them "
                f"with read_uri"
            )
        self.root = local.absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self._refuse_lost_ledger()
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = self._open_db()
        self._ckpt = None

    # ------------------------------------------------------------------ lifecycle
    def _refuse_lost_ledger(self) -> None:
        if (self.root / "ledger.sqlite").exists():
            return
        steps = [p.name for p in self.root.iterdir() if _STEP_DIR_RE.match(p.name) and p.is_dir()]
        ckpt = self.root / "ckpt"
        ckpts = [p.name for p in ckpt.iterdir() if p.name.startswith("step_")] if ckpt.is_dir() else []
        if steps or ckpts:
            held = ", ".join(
                part
                for part in (
                    f"{len(steps)} step folders" if steps else "",
                    f"checkpoints {sorted(ckpts)[-3:]}" if ckpts else "",
                )
                if part
            )
            raise StoreError(
                f"the run's ledger {self.root / 'ledger.sqlite'} is missing although the run already has "
                f"{held}: continuing would re-create an empty ledger and lose which prompts were drawn, "
                f"finished or in flight",
                fix=(
                    "restore ledger.sqlite (with ledger.sqlite-wal if there was one) from a backup, or "
                    "start a new run: set a new trainer.experiment_name, or delete the run folder"
                ),
            )

    def _open_db(self) -> sqlite3.Connection:
        db = sqlite3.connect(
            str(self.root / "ledger.sqlite"), timeout=60.0, isolation_level=None, check_same_thread=False
        )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=60000")
        db.executescript(
            """
            CREATE TABLE IF NOT EXISTS kv (
                key TEXT PRIMARY KEY,
                uid TEXT NOT NULL,
                partition TEXT NOT NULL,
                is_prompt INTEGER NOT NULL,
                status TEXT,
                global_steps INTEGER,
                tags TEXT NOT NULL,
                payload BLOB
            );
            CREATE INDEX IF NOT EXISTS kv_part_prompt_status ON kv(partition, is_prompt, status);
            CREATE INDEX IF NOT EXISTS kv_uid ON kv(uid);
            CREATE INDEX IF NOT EXISTS kv_steps ON kv(partition, global_steps);
            """
        )
        return db

    def close(self) -> None:
        """Close the ledger connection (the store cannot be used afterwards)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        return {"root": str(self.root)}

    def __setstate__(self, state: dict) -> None:
        RunStore.__init__(self, state["root"])

    def __repr__(self) -> str:
        return f"RunStore({str(self.root)!r})"

    @property
    def checkpoints(self):
        """The run's :class:`~dapo_core.store.checkpoint.CheckpointDir` (``root/ckpt``), opened on first
        use."""
        if self._ckpt is None:
            self._ckpt = CheckpointDir(self.root)
        return self._ckpt

    # ------------------------------------------------------------------ ledger
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"RunStore({self.root}) is closed: create a new RunStore")
        return self._db

    def _raise_if_full(self, exc: sqlite3.OperationalError) -> None:
        """Turn SQLite's "database or disk is full" into :class:`DiskFull` naming the ledger."""
        if "full" in str(exc).lower():
            path = self.root / "ledger.sqlite"
            raise DiskFull(
                f"the disk is full: the ledger {path} could not grow ({exc}). The transaction was rolled "
                f"back: the ledger holds the last committed state",
                fix=(
                    f"free space on the filesystem that holds {self.root} (or move the run to a larger disk "
                    f"via trainer.runs_dir), then resume the run with the same command"
                ),
            ) from exc

    def _tx(self):
        """Context manager: one IMMEDIATE transaction under the instance lock."""
        store = self  # the inner class's methods take their own `self` (the _Tx instance)

        class _Tx:
            def __enter__(self) -> sqlite3.Connection:
                store._lock.acquire()
                try:
                    store._conn().execute("BEGIN IMMEDIATE")
                except BaseException:
                    store._lock.release()
                    raise
                return store._conn()

            def __exit__(self, et: object, ev: object, tb: object) -> Literal[False]:
                db = store._conn()
                try:
                    if et is None:
                        db.execute("COMMIT")
                    elif db.in_transaction:  # SQLite already rolled back after SQLITE_FULL
                        db.execute("ROLLBACK")
                except sqlite3.OperationalError as e:  # COMMIT on a full disk: roll back, then say so
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    store._raise_if_full(e)
                    raise
                finally:
                    store._lock.release()
                if isinstance(ev, sqlite3.OperationalError):
                    store._raise_if_full(ev)
                return False

        return _Tx()

    @staticmethod
    def _row(key: str, tags: Mapping[str, Any], payload: bytes | None, partition: str) -> tuple:
        if not isinstance(tags, Mapping):
            raise StoreError(f"tags of key {key!r} must be a mapping, got {type(tags).__name__}")
        if not isinstance(partition, str) or not partition:
            raise StoreError(f"partition of key {key!r} must be a non-empty str (e.g. 'train', 'val')")
        _check_tag_names(tags)
        status, is_prompt, gs = _columns(tags)
        uid = _uid_of(key, bool(is_prompt))
        if payload is not None and not isinstance(payload, bytes | bytearray | memoryview):
            raise StoreError(
                f"payload of key {key!r} must be bytes (e.g. Arrow IPC), got {type(payload).__name__}"
            )
        try:
            text = json.dumps(dict(tags), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise StoreError(
                f"tags of key {key!r} are not JSON-serialisable ({e}): use str/int/float/bool/None, "
                f"lists and dicts"
            ) from None
        return (key, uid, partition, is_prompt, status, gs, text, None if payload is None else bytes(payload))

    _UPSERT = (
        "INSERT INTO kv(key, uid, partition, is_prompt, status, global_steps, tags, payload) "
        "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE SET uid=excluded.uid, "
        "partition=excluded.partition, is_prompt=excluded.is_prompt, status=excluded.status, "
        "global_steps=excluded.global_steps, tags=excluded.tags, payload=excluded.payload"
    )

    def put(
        self, key: str, tags: Mapping[str, Any], payload: bytes | None = None, partition: str = "train"
    ) -> None:
        """Insert or replace ``key`` with ``tags`` (and an optional bytes ``payload``) in ``partition``."""
        self.put_many([(key, tags, payload)], partition=partition)

    def put_many(self, items: Iterable[tuple], partition: str = "train") -> int:
        """Insert or replace many keys in ONE transaction; ``items`` are ``(key, tags)`` or ``(key, tags,
        payload)``.

        Returns the number of keys written. Either all are written or none (on error).
        """
        rows = []
        for item in items:
            if len(item) == 2:
                key, tags = item
                payload = None
            elif len(item) == 3:
                key, tags, payload = item
            else:
                raise StoreError(f"put_many item {item!r:.80} must be (key, tags) or (key, tags, payload)")
            rows.append(self._row(key, tags, payload, partition))
        with self._tx() as db:
            db.executemany(self._UPSERT, rows)
        return len(rows)

    def register_prompts(
        self,
        uids: Iterable[str],
        global_steps: int,
        payloads: Sequence[bytes | None] | None = None,
        status: str = "pending",
        partition: str = "train",
    ) -> int:
        """Register prompt keys ``{uid}`` (``is_prompt=True``, ``status``, ``global_steps``), one transaction.

        ``payloads`` (optional, one per uid) keep what is needed to re-issue the prompt after a crash (the
        replay-buffer order stores the prompt row). Returns the number of keys written.
        """
        uids = list(uids)
        if payloads is not None and len(payloads) != len(uids):
            raise StoreError(f"register_prompts: {len(payloads)} payloads for {len(uids)} uids")
        tags = {"is_prompt": True, "status": status, "global_steps": int(global_steps)}
        items = [(u, tags, None if payloads is None else payloads[i]) for i, u in enumerate(uids)]
        return self.put_many(items, partition=partition)

    def apply(
        self,
        *,
        puts: Iterable[tuple] = (),
        merges: Mapping[str, Mapping[str, Any]] | None = None,
        deletes: Iterable[str] = (),
        partition: str = "train",
    ) -> None:
        """Several ledger changes in ONE transaction: ``puts`` as in :meth:`put_many` (in ``partition``),
        ``merges`` {key: tags} merged into existing keys (payload kept; ``KeyError`` if missing), then
        ``deletes``.
        """
        rows = []
        for item in puts:
            key, tags, payload = (*item, None)[:3] if len(item) == 2 else item
            rows.append(self._row(key, tags, payload, partition))
        merges = dict(merges or {})
        for tags in merges.values():
            _check_tag_names(tags)
        deletes = list(deletes)
        with self._tx() as db:
            if rows:
                db.executemany(self._UPSERT, rows)
            if merges:
                self._merge_in_tx(db, merges)
            if deletes:
                db.executemany("DELETE FROM kv WHERE key=?", [(k,) for k in deletes])

    @staticmethod
    def _merge_in_tx(db: sqlite3.Connection, merges: Mapping[str, Mapping[str, Any]]) -> int:
        rows = []
        for key, tags in merges.items():
            r = db.execute("SELECT tags FROM kv WHERE key=?", (key,)).fetchone()
            if r is None:
                raise KeyError(f"update_tags: ledger key {key!r} not found; put() it first")
            merged = json.loads(r[0])
            merged.update(tags)
            status, is_prompt, gs = _columns(merged)
            if is_prompt:
                _uid_of(key, True)
            rows.append((json.dumps(merged, sort_keys=True, allow_nan=False), status, is_prompt, gs, key))
        db.executemany("UPDATE kv SET tags=?, status=?, is_prompt=?, global_steps=? WHERE key=?", rows)
        return len(rows)

    def get(self, key: str) -> tuple[dict, bytes | None]:
        """Return ``(tags, payload)`` of ``key``; raises ``KeyError`` naming the key if it does not exist."""
        with self._lock:
            row = self._conn().execute("SELECT tags, payload FROM kv WHERE key=?", (key,)).fetchone()
        if row is None:
            raise KeyError(f"ledger key {key!r} not found in {self.root / 'ledger.sqlite'}")
        return json.loads(row[0]), row[1]

    def get_many(self, keys: Sequence[str]) -> dict[str, dict]:
        """Tags of every existing key in ``keys`` (missing keys are left out)."""
        out: dict[str, dict] = {}
        keys = list(keys)
        with self._lock:
            for i in range(0, len(keys), 500):
                part = keys[i : i + 500]
                q = f"SELECT key, tags FROM kv WHERE key IN ({','.join('?' * len(part))})"
                for k, t in self._conn().execute(q, part):
                    out[k] = json.loads(t)
        return out

    def partition_of(self, key: str) -> str:
        """The partition of ``key`` (``KeyError`` if missing)."""
        with self._lock:
            row = self._conn().execute("SELECT partition FROM kv WHERE key=?", (key,)).fetchone()
        if row is None:
            raise KeyError(f"ledger key {key!r} not found")
        return row[0]

    def update_tags(self, keys: str | Iterable[str], **tags: Any) -> int:
        """Merge ``tags`` into the tags of ``keys`` (one key or many) in one transaction.

        Raises ``KeyError`` naming the first missing key (and writes nothing). Returns the number updated.
        """
        if isinstance(keys, str):
            keys = [keys]
        keys = list(keys)
        _check_tag_names(tags)
        with self._tx() as db:
            return self._merge_in_tx(db, dict.fromkeys(keys, tags))

    def _where(self, partition: str | None, tag_equals: Mapping[str, Any]) -> tuple[str, list]:
        _check_tag_names(tag_equals)
        clauses, args = [], []
        if partition is not None:
            clauses.append("partition=?")
            args.append(partition)
        for name, value in tag_equals.items():
            if name in _INDEXED:
                col = name
                if name == "is_prompt":
                    value = int(bool(value))
            elif name == "uid":
                col = "uid"
            else:
                col = f"json_extract(tags, '$.{name}')"
            if value is None:
                clauses.append(f"{col} IS NULL")
            elif isinstance(value, list | tuple | set | frozenset):
                vals = [_sql_value(v) for v in value]
                if not vals:
                    clauses.append("0")
                else:
                    clauses.append(f"{col} IN ({','.join('?' * len(vals))})")
                    args.extend(vals)
            else:
                clauses.append(f"{col}=?")
                args.append(_sql_value(value))
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", args

    def list_keys(self, partition: str | None = None, **tag_equals: Any) -> list[str]:
        """Keys (in insertion order) whose tags equal every ``tag_equals`` (a list/tuple value means "one
        of").

        ``uid=`` selects a prompt and its trajectories. ``None`` matches a missing tag.
        """
        where, args = self._where(partition, tag_equals)
        with self._lock:
            return [r[0] for r in self._conn().execute(f"SELECT key FROM kv{where} ORDER BY rowid", args)]

    def items(self, partition: str | None = None, **tag_equals: Any) -> list[tuple[str, dict]]:
        """Like :meth:`list_keys` but returns ``(key, tags)`` pairs (one query, for snapshots)."""
        where, args = self._where(partition, tag_equals)
        with self._lock:
            rows = self._conn().execute(f"SELECT key, tags FROM kv{where} ORDER BY rowid", args).fetchall()
        return [(k, json.loads(t)) for k, t in rows]

    def count(self, partition: str | None = None, **tag_equals: Any) -> int:
        """Number of keys matching like :meth:`list_keys`."""
        where, args = self._where(partition, tag_equals)
        with self._lock:
            return self._conn().execute(f"SELECT COUNT(*) FROM kv{where}", args).fetchone()[0]

    def delete(self, keys: str | Iterable[str]) -> int:
        """Delete ``keys`` (missing ones are ignored) in one transaction; returns the number deleted."""
        if isinstance(keys, str):
            keys = [keys]
        keys = list(keys)
        with self._tx() as db:
            before = db.total_changes
            db.executemany("DELETE FROM kv WHERE key=?", [(k,) for k in keys])
            return db.total_changes - before

    def reissue_inflight(self, partition: str, current_step: int) -> int:
        """Crash recovery: re-issue every prompt of ``partition`` left pending/running.

        In one transaction, each such prompt loses its (partial) trajectories and is re-tagged
        ``status="pending"``, ``global_steps=current_step`` (its other tags and payload are kept).
        Finished/failed prompts are untouched. Returns the number of prompts re-issued (0 = nothing in
        flight).
        """
        _check_step(current_step)
        with self._tx() as db:
            rows = db.execute(
                "SELECT key, tags FROM kv WHERE partition=? AND is_prompt=1 AND status IN (?, ?)",
                (partition, *INFLIGHT_STATUSES),
            ).fetchall()
            if not rows:
                return 0
            updates = []
            for key, text in rows:
                tags = json.loads(text)
                tags.update(is_prompt=True, status="pending", global_steps=current_step)
                updates.append((json.dumps(tags, sort_keys=True), current_step, key))
            db.executemany(
                "DELETE FROM kv WHERE uid=? AND is_prompt=0 AND partition=?",
                [(key, partition) for key, _ in rows],
            )
            db.executemany("UPDATE kv SET tags=?, status='pending', global_steps=? WHERE key=?", updates)
        return len(rows)

    def drop_prompts_after(self, partition: str, step: int) -> int:
        """Delete (one transaction) every prompt of ``partition`` registered after ``step`` or still in
        flight, with its trajectories: when a run resumes with changed inputs, nothing generated from the
        old ones for later steps may be replayed. Returns the number of prompts dropped."""
        _check_step(step)
        with self._tx() as db:
            uids = [
                r[0]
                for r in db.execute(
                    "SELECT uid FROM kv WHERE partition=? AND is_prompt=1 AND "
                    "(global_steps > ? OR status IN (?, ?))",
                    (partition, step, *INFLIGHT_STATUSES),
                ).fetchall()
            ]
            db.executemany("DELETE FROM kv WHERE uid=? AND partition=?", [(u, partition) for u in uids])
        return len(uids)

    # ------------------------------------------------------------------ stages
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

    def write_stage(
        self, step: int, stage: str, table: pa.Table, meta: Mapping[str, Any] | None = None
    ) -> str:
        """Commit ``table`` as the output of ``stage`` at ``step``; returns its ``file://`` URI.

        Order: (un-commit an older version) → data to temp file + fsync + rename → manifest to temp file +
        fsync + rename + dir fsync. A crash at any point leaves the stage either committed or absent.
        """
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise StoreError(
                f"write_stage(step={step}, stage={stage!r}): table must be a pyarrow.Table, "
                f"got {type(table).__name__}"
            )
        data_path, man_path = self._paths(step, stage)
        meta = dict(meta or {})
        try:
            meta_json = json.loads(json.dumps(meta, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise StoreError(
                f"write_stage(step={step}, stage={stage!r}): meta is not JSON-serialisable ({e})"
            ) from None
        data_path.parent.mkdir(parents=True, exist_ok=True)
        if man_path.exists():  # un-commit first so a crash mid-rewrite never pairs old manifest + new data
            unlink_missing_ok(man_path)
            fsync_dir(data_path.parent)
        sinks: list[_HashingSink] = []

        def write_ipc(f: BinaryIO) -> None:
            sinks.append(_HashingSink(f))
            with ipc.new_file(sinks[-1], table.schema) as writer:
                writer.write_table(table)

        atomic_write(data_path, write_ipc, fsync_parent=False)  # the manifest's write syncs the directory
        sink = sinks[-1]
        manifest = {
            "format": 1,
            "step": step,
            "stage": stage,
            "file": data_path.name,
            "rows": table.num_rows,
            "schema_hash": schema_hash(table.schema),
            "columns": table.schema.names,
            "sha256": sink.sha.hexdigest(),
            "bytes": sink.nbytes,
            "meta": meta_json,
            "created": time.time(),
        }
        atomic_write_bytes(man_path, json.dumps(manifest, sort_keys=True, indent=1).encode())
        return data_path.as_uri()

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
        return man

    def meta(self, step: int, stage: str) -> dict:
        """The ``meta`` dict given to :meth:`write_stage` for this committed stage."""
        return self.manifest(step, stage).get("meta", {})

    def is_committed(self, step: int, stage: str) -> bool:
        """True when the stage's manifest exists and names a file of the recorded size (no checksum read)."""
        try:
            man = self.manifest(step, stage)
        except StoreError:
            return False
        data = self.step_dir(step) / man["file"]
        try:
            return data.stat().st_size == man["bytes"]
        except FileNotFoundError:
            return False

    def verify_stage(self, step: int, stage: str) -> dict:
        """Check a committed stage's file against its manifest (size + sha256); returns the manifest.

        Raises :class:`StageNotCommitted` or :class:`StoreCorruption` naming the file.
        """
        man = self.manifest(step, stage)
        self._read_verified(self.step_dir(step) / man["file"], man, verify=True)
        return man

    def _read_verified(self, path: Path, man: dict, verify: bool) -> pa.Table:
        try:
            if verify:
                digest, size, data = _sha256_file(path)
            else:
                with open(path, "rb") as f:
                    data = f.read()
                digest, size = None, len(data)
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
            table = ipc.open_file(pa.py_buffer(data)).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreCorruption(f"{path} is not a readable Arrow IPC file ({e})") from None
        if table.num_rows != man.get("rows", table.num_rows):
            raise StoreCorruption(f"{path} has {table.num_rows} rows, its manifest says {man['rows']}")
        return table

    def read_stage(self, step: int, stage: str, verify: bool = True) -> pa.Table:
        """Read a committed stage (checksum verified unless ``verify=False``)."""
        man = self.manifest(step, stage)
        return self._read_verified(self.step_dir(step) / man["file"], man, verify)

    def read_uri(self, uri: str, verify: bool = True) -> pa.Table:
        """Read an Arrow IPC file by URI (``file://`` or any fsspec URL).

        When a manifest sits beside the file (a committed stage), its size and checksum are verified; a
        stage file whose manifest is missing is refused (it is not committed).
        """
        local = _local_path_from_uri(uri)
        if local is not None:
            name = local.name
            if name.endswith(".arrow"):
                man_path = local.with_name(name[: -len(".arrow")] + _MANIFEST_SUFFIX)
                if man_path.exists():
                    try:
                        man = json.loads(man_path.read_bytes())
                    except ValueError:
                        raise StoreCorruption(f"manifest {man_path} is unreadable") from None
                    return self._read_verified(local, man, verify)
                if _STEP_DIR_RE.match(local.parent.name):
                    raise StageNotCommitted(f"{uri} is not committed (no {man_path.name} beside it)")
            try:
                with open(local, "rb") as f:
                    return ipc.open_file(pa.py_buffer(f.read())).read_all()
            except FileNotFoundError:
                raise StoreError(f"read_uri: {uri} does not exist") from None
        with fsspec.open(uri, "rb") as f:
            return ipc.open_file(pa.py_buffer(f.read())).read_all()

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

    def delete_stage(self, step: int, stage: str) -> bool:
        """Un-commit (manifest first) and delete a stage's files; returns whether anything was there."""
        data_path, man_path = self._paths(step, stage)
        existed = man_path.exists() or data_path.exists()
        if man_path.exists():
            unlink_missing_ok(man_path)
            fsync_dir(man_path.parent)
        unlink_missing_ok(data_path)
        return existed

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

    # ------------------------------------------------------------------ run-level files
    def _run_file(self, name: str) -> Path:
        if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9_.-]+$", name) or name.startswith("."):
            raise StoreError(f"run file name {name!r} is invalid: a plain file name like 'config.json'")
        return self.root / name

    def write_json(self, name: str, obj: Any) -> Path:
        """Atomically write ``obj`` as JSON to ``root/name`` (e.g. the resolved config, the run state)."""
        path = self._run_file(name)
        try:
            data = json.dumps(obj, sort_keys=True, indent=1, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise StoreError(f"write_json({name!r}): object is not JSON-serialisable ({e})") from None
        atomic_write_bytes(path, data)
        return path

    def read_json(self, name: str, default: Any = ...) -> Any:
        """Read ``root/name`` as JSON; without ``default`` a missing file raises ``FileNotFoundError``."""
        path = self._run_file(name)
        try:
            return json.loads(path.read_bytes())
        except FileNotFoundError:
            if default is not ...:
                return default
            raise FileNotFoundError(
                f"run file {path} does not exist (write_json({name!r}, ...) first)"
            ) from None
