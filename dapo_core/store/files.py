"""Atomic files: write to a temp file beside the target, fsync, rename, fsync the directory.

The primitive under every commit of the run store (stage manifests, run files) and of checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


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


def atomic_write(path: str | Path, fill: Callable[[BinaryIO], object], *, fsync_parent: bool = True) -> None:
    """Write `path` atomically: `fill(f)` writes into a temp file in the same directory, which is fsynced
    and renamed over `path` (removed if `fill` fails); then the directory is fsynced unless
    `fsync_parent=False` (for a caller that commits with a later atomic write in the same directory, as the
    run store's manifests do)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_missing_ok(tmp)
        raise
    if fsync_parent:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (`atomic_write`: temp file, fsync, rename, fsync dir)."""
    atomic_write(path, lambda f: f.write(data))


def unlink_missing_ok(path: Path) -> None:
    """Remove `path`; a missing file is not an error."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
