"""A trust record survives a crash mid-write (`dapo_core/store/trust.py`): a process rewriting a stage file's
record in a tight loop is SIGKILLed at several points; afterwards the record is always one of the two
complete records it was alternating between (the rename is atomic, nothing torn is ever read as a record),
a verified read in another process still returns the stage (trusted or hashed, never wrong), and a temp file
a kill leaves behind is no stage: the listing shows the one committed stage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa

from dapo_core.store import RunStore, stage_io, trust
from dapo_core.store.stage_files import StageFiles, io_counters
from tests.integration.conftest import kill_at

REPO = Path(__file__).resolve().parents[2]

_LOOPER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dapo_core.store import trust
    path, sha, marker, after = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    key = trust.stat_key(path.stat())
    other = (key[0], key[1], key[2], key[3], key[4] + 1)  # a record of another identity: never trusted
    i = 0
    while True:
        how = "read" if i % 2 else "write"
        trust.write_record(path, key if i % 2 else other, sha, time.time_ns(), True, how)
        i += 1
        if i == after:
            marker.touch()
    """
)


def test_a_record_killed_mid_write_is_either_whole_or_the_previous_one(tmp_path):
    store = RunStore(tmp_path / "run")
    rows, width = 32, 256
    offsets = np.arange(0, rows * width + 1, width, dtype=np.int32)
    table = pa.table(
        {
            "uid": pa.array([f"u{i // 4}" for i in range(rows)]),
            "sample_idx": pa.array(np.arange(rows) % 4, pa.int32()),
            "x": pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(rows * width))),
        }
    )
    store.write_stage(1, "generate_g0", table)
    path = store.step_dir(1) / "generate_g0.arrow"
    sha = store.manifest(1, "generate_g0")["sha256"]
    key = trust.stat_key(path.stat())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for round_, after in enumerate((50, 301, 1000, 2017, 4000)):
        marker = tmp_path / f"marker{round_}"
        victim = subprocess.Popen(
            [sys.executable, "-c", _LOOPER, str(path), sha, str(marker), str(after)],
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        kill_at(victim, marker, timeout_s=120)
        rec = trust.read_record(path)
        assert rec is not None, "a killed record write left no complete record behind"
        assert rec["sha256"] == sha and rec["key"] in (key, (*key[:4], key[4] + 1))
        # another process's verified read: the right table whichever record was left
        reader = StageFiles(store.root)
        io_counters(reset=True)
        stage_io._VERIFIED.clear()  # as a fresh process
        assert reader.read_stage(1, "generate_g0").equals(table)
        c = io_counters()
        assert c["files_hashed"] + c["files_trusted"] == 1
        if rec["key"] != key:  # the other identity's record is never trusted: the file was hashed
            assert c["files_hashed"] == 1
    assert store.committed_stages(1) == ["generate_g0"]  # whatever temp files the kills left behind
    assert trust.read_record(path) is not None
    store.close()
