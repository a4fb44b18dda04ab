"""Atomic files: write to a temp file beside the target, fsync, rename, fsync the directory.

The primitive under every commit of the run store (stage manifests, run files) and of checkpoints.

A full disk (ENOSPC, or a quota: EDQUOT) while writing becomes :class:`DiskFull`, which names the file, the
free space left and the fix; the temp file is removed, so the target keeps its last committed content.
Fault injection for tests: `write_hook(path)` is called before each write (raise from it to simulate a
failure), and the environment variable ``DAPO_FAULT_DISK_FULL=<text>`` makes every atomic write whose path
contains ``<text>`` fail with ENOSPC (it reaches Ray workers and subprocesses; never set it otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from dapo_core.errors import DapoUserError

__all__ = [
    "DiskFull",
    "atomic_write",
    "atomic_write_bytes",
    "disk_full_error",
    "fsync_dir",
    "unlink_missing_ok",
]

FAULT_ENV = "DAPO_FAULT_DISK_FULL"
"""Test-only: atomic writes to paths containing this variable's value fail with ENOSPC."""
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

write_hook: Callable[[Path], None] | None = None
"""Test-only fault hook: called with the target path before each atomic write (it may raise)."""


class DiskFull(DapoUserError, OSError):
    """The filesystem ran out of space (or quota) while the store was committing a file."""


def _free_text(path: Path) -> str:
    for p in (path, *path.parents):
        try:
            free = shutil.disk_usage(p).free
        except OSError:
            continue
        return f"{free / 2**20:.1f} MiB free on the filesystem of {p}"
    return "free space unknown"


def disk_full_error(exc: BaseException, path: str | Path) -> DiskFull | None:
    """A :class:`DiskFull` naming `path` if `exc` (or an exception it wraps, e.g. in a Ray error) is ENOSPC or
    EDQUOT, else None."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 10:
        if isinstance(cur, DiskFull):
            return cur
        if isinstance(cur, OSError) and cur.errno in _FULL_ERRNOS:
            break
        nxt = getattr(cur, "cause", None)
        cur = nxt if isinstance(nxt, BaseException) else (cur.__cause__ or cur.__context__)
        seen += 1
    else:
        return None
    path = Path(path)
    err = DiskFull(
        f"the disk is full: writing {path} failed ({os.strerror(cur.errno or errno.ENOSPC)}; "
        f"{_free_text(path.parent)}). The store is consistent: what was being written is not committed and "
        f"the last commit is intact",
        fix=(
            f"free space on the filesystem that holds {path.parent} (or set trainer.runs_dir to a larger "
            f"disk and move the run there), then resume the run with the same command"
        ),
    )
    err.errno = cur.errno
    err.filename = str(path)
    return err


def _inject_fault(path: Path) -> None:
    if write_hook is not None:
        write_hook(path)
    needle = os.environ.get(FAULT_ENV)
    if needle and needle in str(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so that renames/creations inside it survive a power loss (no-op where
    unsupported)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: str | Path,
    fill: Callable[[BinaryIO], object],
    *,
    fsync_parent: bool = True,
    durable: bool = True,
) -> None:
    """Write `path` atomically: `fill(f)` writes into a temp file in the same directory, which is fsynced
    and renamed over `path` (removed if `fill` fails); then the directory is fsynced unless
    `fsync_parent=False` (for a caller that commits with a later atomic write in the same directory, as the
    run store's manifests do). ``durable=False`` skips both fsyncs: readers still see the old or the new
    content, never a mix, but after a power cut the file may be missing or empty (for caches such as the
    store's trust records, which check themselves). A full disk raises :class:`DiskFull` naming `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            _inject_fault(path)
            fill(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        unlink_missing_ok(tmp)
        full = disk_full_error(exc, path)
        if full is not None and full is not exc:
            raise full from exc
        raise
    if fsync_parent and durable:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (`atomic_write`: temp file, fsync, rename, fsync dir; no fsyncs
    with ``durable=False``)."""
    atomic_write(path, lambda f: f.write(data), durable=durable)


def unlink_missing_ok(path: Path) -> None:
    """Remove `path`; a missing file is not an error."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
