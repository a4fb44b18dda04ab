"""Atomic files: write to a temp file beside the target, fsync, rename, fsync the directory.

The primitive under every commit of the run store (stage manifests, run files) and of checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


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


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same directory, fsync, rename, fsync dir."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_missing_ok(tmp)
        raise
    fsync_dir(path.parent)


def unlink_missing_ok(path: Path) -> None:
    """Remove `path`; a missing file is not an error."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
