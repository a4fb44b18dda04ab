"""One stage file on disk: hashed while it is written, verified (or taken on trust) when it is read.

A write streams the Arrow IPC file through a sha256 (temp file, fsync, rename) and, once the manifest is
committed, leaves a trust record of the file's identity (:mod:`dapo_core.store.trust`). A verified read
memory-maps the file and hashes the mapping in place, unless this process or a trust record vouches for the
file's unchanged identity; an unverified read only maps it. Either way the size, the sha256 (when verified),
the Arrow format and the row count are checked against the manifest, and run-length ends are expanded
(:mod:`dapo_core.store.run_ends`). :func:`io_counters` counts the bytes and files this process read and wrote.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
from pyarrow import ipc

from dapo_core.store import trust
from dapo_core.store.files import atomic_write
from dapo_core.store.manifests import StoreCorruption
from dapo_core.store.run_ends import decode_file_table

__all__ = ["Written", "count_mapped", "io_counters", "read_file", "record_trust", "write_file"]

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
_VERIFIED: OrderedDict[str, tuple[trust.StatKey, str]] = OrderedDict()
"""path -> (stat identity, sha256) of the files this process verified or trusted (the same rules as a trust
record, :mod:`.trust`): later reads here need not even read the record."""
_VERIFIED_MAX = 4096
_OVERLAP_MIN = 1 << 20
"""Buffers at least this large are hashed on a helper thread while the same buffer is written."""
_HASHER: ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


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


def count_mapped(nbytes: int) -> None:
    """Count ``nbytes`` of columns an unverified read returned from memory-mapped files."""
    _count("mapped", nbytes)


def _bump(name: str) -> None:
    with _COUNTER_LOCK:
        _COUNTERS[name] += 1


def _remember_verified(name: str, key: trust.StatKey, digest: str) -> None:
    with _COUNTER_LOCK:
        _VERIFIED[name] = (key, digest)
        _VERIFIED.move_to_end(name)
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)


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
    _bump("files_hashed")
    if always or digest != expect or buf.size != key[2]:
        return digest, buf.size, buf, False
    if trust.stat_key(os.stat(path)) == key and trust.trustworthy(key, taken_ns, fine):
        _remember_verified(name, key, digest)
        trust.write_record(path, key, digest, taken_ns, fine, "read")
        _bump("trust_records_written")
    return digest, buf.size, buf, False


def read_file(path: Path, man: dict[str, Any], verify: bool) -> pa.Table:
    """The file table of a committed stage file, checked against its manifest ``man`` (size, row count, and
    the sha256 when ``verify``; unverified reads are memory-mapped and touch only the pages used)."""
    try:
        data: pa.Buffer | pa.MemoryMappedFile
        if verify:  # mapped and hashed in place; the table is zero-copy over the checked pages
            digest, size, data, trusted = _sha256_mapped(
                path, str(man["sha256"]), trust.fine_ctime(path.parent)
            )
            _count("trusted" if trusted else "read", size)
        else:
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
    if table.num_rows != man["rows"]:
        raise StoreCorruption(f"{path} has {table.num_rows} rows, its manifest says {man['rows']}")
    return decode_file_table(table, man, path)


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

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0
        self.closed = False

    def write(self, data: bytes | memoryview | pa.Buffer) -> int:
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


@dataclass(frozen=True)
class Written:
    """A stage file just written: its sha256 and size, and its stat identity taken right after the rename."""

    sha256: str
    nbytes: int
    identity: trust.StatKey
    taken_ns: int


def write_file(path: Path, file_table: pa.Table) -> Written:
    """Write ``file_table`` as the Arrow IPC file ``path`` (temp file, fsync, rename; the directory is synced
    by the manifest's write), hashing the bytes as they are written."""
    sinks: list[_HashingSink] = []

    def write_ipc(f: BinaryIO) -> None:
        sinks.append(_HashingSink(f))
        with ipc.new_file(sinks[-1], file_table.schema) as writer:
            writer.write_table(file_table)

    atomic_write(path, write_ipc, fsync_parent=False)
    taken_ns = time.time_ns()
    identity = trust.stat_key(os.stat(path))  # after the rename: the committed file's identity
    sink = sinks[-1]
    _count("written", sink.nbytes)
    return Written(sink.sha.hexdigest(), sink.nbytes, identity, taken_ns)


def record_trust(path: Path, written: Written) -> None:
    """Leave the writer's trust record of ``path`` (after its manifest is committed), where the identity taken
    at :func:`write_file` provably changes with any later write (:mod:`.trust`)."""
    fine = trust.fine_ctime(path.parent)
    if trust.trustworthy(written.identity, written.taken_ns, fine) and written.identity[2] == written.nbytes:
        trust.write_record(path, written.identity, written.sha256, written.taken_ns, fine, "write")
