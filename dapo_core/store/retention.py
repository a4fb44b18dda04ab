"""Retention of step data: keep what a resume replays, and the steps the user asked to keep.

A resume from a checkpoint at step ``c`` replays the committed stages of the steps after ``c`` and needs
nothing of the steps up to ``c`` (the checkpoint and the ledger hold the rest). So :func:`apply_retention`
deletes the step folders ``step_<s>`` with ``s <= c``, except every ``keep_every``-th step
(``trainer.keep_rollouts_every``; 0 keeps none), the steps a kept stage's base chain reaches into, and the
``pinned`` steps (the replay buffer's ``replay_add`` files, :func:`dapo_core.store.replay.referenced_steps`).

Deleting is crash-safe: a doomed folder is first renamed to a hidden trash name (``.trash-step_<s>-<id>``;
the root is then fsynced), which removes the step from :meth:`StageFiles.steps` and every read at once; only
then is the trash removed. A crash in between leaves a trash folder that nothing reads and that the next call
(or :func:`empty_trash`) removes. The latest checkpoint is committed before retention runs, and only steps up
to it are candidates.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable

from dapo_core.store.files import fsync_dir
from dapo_core.store.stage_files import StageFiles

__all__ = ["TRASH_PREFIX", "apply_retention", "empty_trash", "retained_steps"]

TRASH_PREFIX = ".trash-"
"""Name prefix of a step folder being deleted."""
_TRASH_RE = re.compile(r"^\.trash-step_\d+-[0-9a-f]+$")

crash_hook: Callable[[str], None] | None = None
"""Test-only: called with ``"renamed"`` after a step folder is renamed to trash and before it is removed
(raise from it to simulate a crash between the two)."""


def retained_steps(
    files: StageFiles, latest_checkpoint: int | None, keep_every: int = 0, pinned: Iterable[int] = ()
) -> tuple[list[int], list[int]]:
    """``(keep, delete)``: the step folders of ``files`` to keep and to delete after a checkpoint at
    ``latest_checkpoint`` (None: no checkpoint yet, everything is kept)."""
    steps = files.steps()
    if latest_checkpoint is None:
        return steps, []
    pins = set(pinned)
    keep = {
        s for s in steps if s > latest_checkpoint or (keep_every > 0 and s % keep_every == 0) or s in pins
    }
    graph = files.stage_graph()
    todo = [ref for ref in graph if ref[0] in keep]
    seen = set(todo)
    while todo:  # the base chains of the kept stages
        for base in graph.get(todo.pop(), []):
            keep.add(base[0])
            if base not in seen:
                seen.add(base)
                todo.append(base)
    return sorted(s for s in steps if s in keep), sorted(s for s in steps if s not in keep)


def empty_trash(files: StageFiles) -> int:
    """Remove trash folders a crashed deletion left behind; returns how many."""
    n = 0
    for p in files.root.iterdir():
        if _TRASH_RE.match(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            n += 1
    return n


def apply_retention(
    files: StageFiles, latest_checkpoint: int | None, keep_every: int = 0, pinned: Iterable[int] = ()
) -> list[int]:
    """Delete the step folders :func:`retained_steps` does not keep (crash-safe, module docstring); returns
    the steps deleted."""
    if keep_every < 0:
        raise ValueError(
            f"trainer.keep_rollouts_every={keep_every}: use 0 (keep none) or a positive step count"
        )
    empty_trash(files)
    _, delete = retained_steps(files, latest_checkpoint, keep_every, pinned)
    if not delete:
        return []
    trash = []
    for s in delete:
        target = files.root / f"{TRASH_PREFIX}step_{s:06d}-{uuid.uuid4().hex[:8]}"
        os.replace(files.step_dir(s), target)
        trash.append(target)
    fsync_dir(files.root)  # the steps are gone for every reader from here on
    if crash_hook is not None:
        crash_hook("renamed")
    for t in trash:
        shutil.rmtree(t, ignore_errors=True)
    return delete
