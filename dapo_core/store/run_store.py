"""The run store: the durable transfer queue and single source of truth of a run, ``runs/<run_id>/``.

- ``ledger.sqlite`` — the prompt/trajectory ledger (SQLite, WAL, ``synchronous=FULL``). Every key carries a
  JSON tag dict; the tags ``status``, ``is_prompt``, ``global_steps`` and the key's ``partition`` are mirrored
  into indexed columns for the trainer's per-step queries. A key may carry a small payload (e.g. the prompt
  row as Arrow IPC, so a prompt can be re-issued after a crash). Prompt keys are ``{uid}``; trajectory keys
  are ``{uid}_{anything}``, so ``uid`` may not contain ``_``. One writer: the flow's driver.
- ``step_<n>/<stage>.arrow`` + ``<stage>.manifest.json`` — stage outputs, committed by their manifest
  (:class:`~dapo_core.store.stage_files.StageFiles`, which :class:`RunStore` extends; any process that can
  reach the directory may write them).
- ``*.json`` run-level files (resolved config, run state), written atomically.
- ``ckpt/`` — checkpoints (:class:`dapo_core.store.checkpoint.CheckpointDir`, :attr:`RunStore.checkpoints`).

The layout, the commit rule and the stage-file calls: ``docs/STORE.md``.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, Self

from dapo_core.store.checkpoint import CheckpointDir
from dapo_core.store.files import DiskFull, atomic_write_bytes
from dapo_core.store.manifests import STEP_DIR_RE as _STEP_DIR_RE
from dapo_core.store.manifests import check_step as _check_step
from dapo_core.store.stage_files import (
    StageFiles,
    StageNotCommitted,
    StoreCorruption,
    StoreError,
    schema_hash,
)

__all__ = [
    "INFLIGHT_STATUSES",
    "PROMPT_STATUSES",
    "RunStore",
    "StageFiles",
    "StageNotCommitted",
    "StoreCorruption",
    "StoreError",
    "schema_hash",
]

PROMPT_STATUSES = ("pending", "running", "finished", "failure")
"""Allowed values of the ``status`` tag of a prompt key."""
INFLIGHT_STATUSES = ("pending", "running")
"""Statuses of a prompt whose group is not settled yet (re-issued after a crash)."""

_TAG_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INDEXED = ("status", "is_prompt", "global_steps")


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
class RunStore(StageFiles):
    """The durable store of one run (ledger + committed stage outputs + run files + checkpoints).

    ``RunStore(root)`` creates ``root`` if needed and opens (or creates) ``root/ledger.sqlite``. A missing
    ledger in a folder that already holds steps or checkpoints is refused (:class:`StoreError`): creating
    an empty one would continue the run with its history gone.
    It is safe to share one instance between threads (a lock serialises ledger access). Pickling a
    store re-opens it from its root on the other side.
    """

    def __init__(self, root: str | Path) -> None:
        StageFiles.__init__(self, root)
        self._refuse_lost_ledger()
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = self._open_db()
        self._ckpt: CheckpointDir | None = None

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

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        return {"root": str(self.root)}

    def __setstate__(self, state: dict) -> None:
        RunStore.__init__(self, state["root"])

    def __repr__(self) -> str:
        return f"RunStore({str(self.root)!r})"

    @property
    def checkpoints(self) -> CheckpointDir:
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

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
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
