"""Step-data retention: after a checkpoint only what a resume replays is kept (plus keep_rollouts_every steps,
base chains and pinned steps); a process SIGKILLed in the middle of a deletion leaves every kept stage
readable and its trash is removed by the next call."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from dapo_core.store import RunStore
from dapo_core.store.retention import apply_retention, retained_steps


def _rows(step: int, n: int = 16) -> pa.Table:
    return pa.table(
        {
            "uid": pa.array([f"{step:04d}{i // 4:028x}" for i in range(n)]),
            "sample_idx": pa.array([i % 4 for i in range(n)], pa.int64()),
            "x": pa.array(np.arange(n, dtype=np.float32) + step),
        }
    )


def _fill(root: Path, steps: range) -> None:
    with RunStore(root) as store:
        for s in steps:
            u = store.write_stage(s, "prompts_g0", _rows(s))
            t = _rows(s).append_column("y", pa.array(np.ones(16, np.float32)))
            store.write_stage(s, "reward_g0", t, base=u)


def test_keeps_resume_steps_every_kth_base_chains_and_pins(tmp_path):
    root = tmp_path / "run"
    _fill(root, range(1, 8))
    with RunStore(root) as store:
        # step 6 builds on a stage of step 1 (as the replay order's batch builds on an earlier step's rows)
        store.write_stage(6, "batch", _rows(1), base=store.stage_uri(1, "prompts_g0"))
        keep, delete = retained_steps(store, 5, keep_every=2, pinned=[3])
        assert keep == [1, 2, 3, 4, 6, 7] and delete == [5]
        assert apply_retention(store, 5, keep_every=0) == [2, 3, 4, 5]
        assert store.steps() == [1, 6, 7]
        assert store.read_stage(6, "batch").equals(_rows(1))
        assert store.read_stage(7, "reward_g0").column("x").equals(_rows(7).column("x"))
        assert apply_retention(store, None) == []  # no checkpoint: nothing goes


CHILD = """
import os, signal, sys
from dapo_core.store import RunStore
from dapo_core.store import retention
retention.crash_hook = lambda where: os.kill(os.getpid(), signal.SIGKILL)
with RunStore(sys.argv[1]) as store:
    retention.apply_retention(store, int(sys.argv[2]))
"""


def test_sigkill_between_rename_and_removal(tmp_path):
    root = tmp_path / "run"
    _fill(root, range(1, 6))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root), "3"], cwd=Path(__file__).parents[2])
    assert proc.returncode == -signal.SIGKILL
    trash = [p.name for p in root.iterdir() if p.name.startswith(".trash-")]
    assert len(trash) == 3  # renamed away, never removed
    with RunStore(root) as store:
        assert store.steps() == [4, 5]  # what a resume from checkpoint 3 replays is all there
        for s in (4, 5):
            assert store.committed_stages(s) == ["prompts_g0", "reward_g0"]
            store.verify_stage(s, "reward_g0")
            assert store.read_stage(s, "reward_g0").num_rows == 16
        assert apply_retention(store, 3) == []
    assert not [p for p in root.iterdir() if p.name.startswith(".trash-")]
    assert os.listdir(root / "step_000004")
