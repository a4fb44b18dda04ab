"""Atomic checkpoint directories: ``<root>/ckpt/step_<n>/`` plus a ``latest`` pointer written last.

A save goes: ``write_fn(tmp_dir)`` fills ``ckpt/.tmp-step_<n>-<rand>/`` → ``MANIFEST.json`` (sha256 and
size of every file, meta incl. the step) → fsync of every file and directory → rename to ``step_<n>``
→ fsync ``ckpt/`` → atomic write of ``latest`` (the step number). A crash at any instant leaves
``latest`` pointing at a complete checkpoint (or absent until the first save); half-written
``.tmp-*`` directories are removed when the directory is next opened. What goes *into* a checkpoint is
the caller's ``write_fn``; one process saves at a time (the flow's driver).

Every load path verifies the manifest (sizes and sha256): :meth:`CheckpointDir.load` for this run's steps,
:func:`verify_folder` for a folder named by path (another run's step, ``dapo eval --checkpoint``). A missing
or unreadable ``latest`` while complete checkpoints exist is recovered by :meth:`CheckpointDir.resume_step`
(the newest checkpoint that verifies, with a warning), never read as "no checkpoint". The manifest detects
damage, not tampering: nothing in a checkpoint is executed (safetensors + JSON, :mod:`.state_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dapo_core.errors import DapoUserError
from dapo_core.store.files import atomic_write_bytes, disk_full_error, fsync_dir

__all__ = [
    "LATEST_NAME",
    "MANIFEST_NAME",
    "CheckpointDir",
    "CheckpointError",
    "enclosing_checkpoint",
    "verify_folder",
]

MANIFEST_NAME = "MANIFEST.json"
"""Name of the manifest file inside each checkpoint directory."""
LATEST_NAME = "latest"
"""Name of the pointer file (contains the latest complete step number)."""

_STEP_RE = re.compile(r"^step_(\d+)$")
_HASH_CHUNK = 8 << 20


class CheckpointError(DapoUserError, ValueError):
    """A checkpoint is missing, incomplete or corrupted, or a save was refused."""


def _sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _read_manifest(folder: Path, label: str) -> dict:
    mp = folder / MANIFEST_NAME
    try:
        man = json.loads(mp.read_bytes())
        if not isinstance(man, dict) or not isinstance(man.get("files"), dict):
            raise ValueError("no files table")
        return man
    except FileNotFoundError:
        raise CheckpointError(
            f"{label}: {mp} is missing (incomplete or deleted checkpoint)",
            fix="load an older step, or point at a ckpt/step_<n> folder written by dapo",
        ) from None
    except ValueError:
        raise CheckpointError(
            f"{label}: {mp} is unreadable (corrupted manifest)", fix="load an older step"
        ) from None


def _verify_files(folder: Path, man: dict, label: str, checksum: bool) -> None:
    for rel, info in sorted(man["files"].items()):
        p = folder / rel
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"{label}: file {rel!r} is missing ({p})", fix="load an older step"
            ) from None
        if size != info["bytes"]:
            raise CheckpointError(
                f"{label}: file {rel!r} has the wrong size ({size} bytes, manifest says {info['bytes']})",
                fix="load an older step",
            )
        if checksum and _sha256_path(p) != info["sha256"]:
            raise CheckpointError(
                f"{label}: file {rel!r} is corrupted (sha256 mismatch with {MANIFEST_NAME})",
                fix="load an older step",
            )


def verify_folder(folder: str | Path, *, checksum: bool = True) -> dict:
    """Check every file of the checkpoint folder `folder` (a ``ckpt/step_<n>``, of any run) against its
    ``MANIFEST.json``; returns the manifest. Raises :class:`CheckpointError` naming the first bad file."""
    folder = Path(folder)
    man = _read_manifest(folder, f"checkpoint {folder}")
    _verify_files(folder, man, f"checkpoint {folder}", checksum)
    return man


def enclosing_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint folder that holds `path`: `path` itself or a parent up to two levels with a
    ``MANIFEST.json`` (``ckpt/step_<n>``, ``ckpt/step_<n>/actor``); None for a plain model folder.

    A folder named ``step_<n>`` directly under ``ckpt/`` without a manifest is refused (an incomplete or
    stripped checkpoint would otherwise load unverified)."""
    path = Path(path).absolute()
    for p in (path, path.parent, path.parent.parent):
        if (p / MANIFEST_NAME).is_file():
            return p
        if _STEP_RE.match(p.name) and p.parent.name == "ckpt":
            raise CheckpointError(
                f"checkpoint {p} has no {MANIFEST_NAME}, so its files cannot be verified (an incomplete or "
                f"altered checkpoint)",
                fix="point at a complete ckpt/step_<n> folder, or at the run folder (its latest checkpoint)",
            )
    return None


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step {step!r} is invalid: pass a non-negative int")
    return step


class CheckpointDir:
    """Manager of ``<root>/ckpt/``: atomic saves, verification, ``latest`` pointer and retention.

    Opening it creates ``ckpt/`` and deletes stale ``.tmp-*`` directories left by crashed saves.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self.dir = self.root / "ckpt"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cleaned_tmp = self._clean_tmp()

    def _clean_tmp(self) -> int:
        n = 0
        for p in self.dir.iterdir():
            if p.name.startswith(".tmp-"):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                n += 1
        if n:
            fsync_dir(self.dir)
        return n

    def path(self, step: int) -> Path:
        """The directory of the checkpoint of ``step``: ``<root>/ckpt/step_<step>``."""
        return self.dir / f"step_{_check_step(step)}"

    def steps(self) -> list[int]:
        """Sorted steps that have a checkpoint directory with a manifest (not verified)."""
        out = []
        for p in self.dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / MANIFEST_NAME).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        """The step named by the ``latest`` pointer, or None before the first completed save.

        A pointer that is not a step number raises :class:`CheckpointError`; :meth:`resume_step` recovers
        from it (and from a missing pointer) instead."""
        try:
            text = (self.dir / LATEST_NAME).read_bytes().decode("utf-8", "replace").strip()
        except FileNotFoundError:
            return None
        if not (text.isascii() and text.isdigit()):
            raise CheckpointError(
                f"{self.dir / LATEST_NAME} holds {text[:40]!r}, not a step number",
                fix="resume the run (it recovers from the newest checkpoint that verifies)",
            )
        return int(text)

    def resume_step(self, warn: Callable[[str], object] = print, *, repair: bool = True) -> int | None:
        """The step to resume from: the ``latest`` pointer's, or — when the pointer is missing, unreadable
        or names a checkpoint that is gone while ``step_<n>`` folders exist — the newest checkpoint that
        verifies, after `warn`-ing what was recovered (the pointer is then rewritten unless
        ``repair=False``, for read-only callers such as a preflight or ``dapo eval``). None only when the
        run has no checkpoint at all. Raises :class:`CheckpointError` when checkpoints exist but none
        verifies (a silent restart at step 0 would discard the run)."""
        steps = self.steps()
        try:
            latest = self.latest_step()
            problem = None if latest is None else f"names step {latest}, which has no complete checkpoint"
        except CheckpointError as e:
            latest, problem = None, e.what
        if latest is not None and latest in steps:
            return latest
        if not steps:
            if latest is not None:
                raise CheckpointError(
                    f"{self.dir / LATEST_NAME} names step {latest} but {self.dir} holds no checkpoint",
                    fix="restore the checkpoint folders, or start a new run (new trainer.experiment_name)",
                )
            return None
        problem = problem or f"{self.dir / LATEST_NAME} is missing"
        bad = []
        for s in reversed(steps):
            try:
                self.verify(s)
            except CheckpointError as e:
                bad.append(f"step {s}: {e.what}")
                continue
            warn(
                f"warning: {problem}; using the newest checkpoint that verifies, {self.path(s)}"
                + (f" (skipped: {'; '.join(bad)})" if bad else "")
                + (f", and rewrote {self.dir / LATEST_NAME}" if repair else "")
            )
            if repair:
                self._write_latest(s)
            return s
        raise CheckpointError(
            f"{problem}, and none of the checkpoints in {self.dir} verifies ({'; '.join(bad)})",
            fix="restore a checkpoint from a backup, or start a new run (new trainer.experiment_name)",
        )

    def _write_latest(self, step: int | None) -> None:
        if step is None:
            (self.dir / LATEST_NAME).unlink(missing_ok=True)
            fsync_dir(self.dir)
        else:
            atomic_write_bytes(self.dir / LATEST_NAME, f"{step}\n".encode())

    def save(
        self,
        step: int,
        write_fn: Callable[[Path], Any],
        meta: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = False,
    ) -> Path:
        """Save checkpoint ``step`` atomically: ``write_fn(tmp_dir)`` writes the files; returns the final
        path.

        An existing ``step_<n>`` that ``latest`` does not point at (left by a crash before the pointer was
        written) is replaced. Replacing the checkpoint ``latest`` points at needs ``overwrite=True``; the
        pointer is moved to the previous complete checkpoint while the swap happens.
        """
        _check_step(step)
        meta = dict(meta or {})
        meta["step"] = step
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"save(step={step}): meta is not JSON-serialisable ({e})") from None
        final = self.path(step)
        latest = self.latest_step()
        if final.exists() and latest == step and not overwrite:
            raise CheckpointError(
                f"checkpoint {final} exists and is the latest: pass overwrite=True to replace it"
            )
        tmp = self.dir / f".tmp-step_{step}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            self._save_into(tmp, step, final, latest, write_fn, meta)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            full = disk_full_error(exc, final)
            if full is not None and full is not exc:
                raise full from exc
            raise
        if latest is None or step >= latest:
            self._write_latest(step)
        return final

    def _save_into(
        self,
        tmp: Path,
        step: int,
        final: Path,
        latest: int | None,
        write_fn: Callable[[Path], Any],
        meta: dict,
    ) -> None:
        """Fill `tmp`, write its manifest, fsync, and swap it in as `final` (the body of `save`)."""
        write_fn(tmp)
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_dir():
                continue
            rel = p.relative_to(tmp).as_posix()
            if rel == MANIFEST_NAME:
                raise CheckpointError(f"save(step={step}): write_fn wrote {MANIFEST_NAME}, a reserved name")
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
            files[rel] = {"sha256": _sha256_path(p), "bytes": p.stat().st_size}
        manifest = {"format": 1, "step": step, "meta": meta, "files": files, "created": time.time()}
        with open(tmp / MANIFEST_NAME, "wb") as f:
            f.write(json.dumps(manifest, sort_keys=True, indent=1).encode())
            f.flush()
            os.fsync(f.fileno())
        for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda x: -len(x.parts)):
            fsync_dir(d)
        if final.exists():
            if latest == step:
                older = [s for s in self.steps() if s < step]
                self._write_latest(older[-1] if older else None)
            trash = self.dir / f".tmp-old-step_{step}-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            fsync_dir(self.dir)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(self.dir)

    def manifest(self, step: int) -> dict:
        """The manifest of checkpoint ``step``; raises :class:`CheckpointError` if missing or unreadable."""
        return _read_manifest(self.path(step), f"checkpoint step {step}")

    def meta(self, step: int) -> dict:
        """The ``meta`` saved with checkpoint ``step`` (includes ``step``)."""
        return self.manifest(step)["meta"]

    def verify(self, step: int, *, checksum: bool = True) -> dict:
        """Check every file of checkpoint ``step`` against its manifest; returns the manifest.

        Raises :class:`CheckpointError` naming the first file that is missing, has the wrong size or
        (with ``checksum=True``) a wrong sha256.
        """
        man = self.manifest(step)
        _verify_files(self.path(step), man, f"checkpoint step {step} ({self.path(step)})", checksum)
        return man

    def load(self, step: int | None = None, *, checksum: bool = True) -> Path:
        """Verify and return the directory of checkpoint ``step`` (default: ``latest``)."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"no checkpoint in {self.dir} ({LATEST_NAME} pointer missing): "
                    f"start from scratch or pass a step"
                )
        self.verify(step, checksum=checksum)
        return self.path(step)

    def rewind(self, step: int) -> list[int]:
        """Make ``step`` the newest checkpoint of this run (resuming from an earlier step starts a new
        branch).

        Checkpoints after ``step`` are moved to ``ckpt/abandoned-<id>/step_<n>`` (kept for inspection, never
        loaded), then ``latest`` is pointed at ``step`` (or removed if this run has no ``step_<step>``, e.g.
        when resuming from another run's folder). Returns the moved steps. Without this, ``latest`` — which
        otherwise only moves forward — would still name the abandoned branch after a crash.
        """
        _check_step(step)
        later = [s for s in self.steps() if s > step]
        if later:
            dest = self.dir / f"abandoned-{uuid.uuid4().hex[:8]}"
            dest.mkdir()
            self._write_latest(
                step if step in self.steps() else None
            )  # pointer first: never names a moved one
            for s in later:
                os.replace(self.path(s), dest / f"step_{s}")
            fsync_dir(self.dir)
        elif (self.latest_step() or -1) > step:
            self._write_latest(step if step in self.steps() else None)
        return later

    def keep_last(self, k: int) -> list[int]:
        """Delete all but the ``k`` newest checkpoints (never the ``latest`` one); returns the deleted
        steps."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise CheckpointError(f"keep_last(k={k!r}): k must be an int >= 1")
        latest = self.latest_step()
        steps = self.steps()
        keep = set(steps[-k:]) | ({latest} if latest is not None else set())
        deleted = []
        for s in steps:
            if s in keep:
                continue
            trash = self.dir / f".tmp-del-step_{s}-{uuid.uuid4().hex[:8]}"
            os.replace(self.path(s), trash)
            fsync_dir(self.dir)
            shutil.rmtree(trash, ignore_errors=True)
            deleted.append(s)
        return deleted
