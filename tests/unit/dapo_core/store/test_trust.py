"""Trust records across processes (`dapo_core/store/trust.py`): a stage file hashed once — by
its writer while writing, or by one reader — is taken on trust by the verified reads of other processes while
its stat identity is unchanged; a byte flipped or a file rewritten through the filesystem after that is still
hashed and refused by another process; a torn or forged record is ignored; `DAPO_STORE_VERIFY=always` hashes
every time. The readers are real separate Python processes, counted through `io_counters`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dapo_core.errors import DapoUserError
from dapo_core.store import RunStore, StoreCorruption, stage_io, trust
from dapo_core.store.stage_files import StageFiles, io_counters
from tests.helpers import unchanged_for, wait_for

REPO = Path(__file__).resolve().parents[4]

_READER = textwrap.dedent(
    """
    import json, os, sys
    from dapo_core.store import trust
    from dapo_core.store.stage_files import StageFiles, StoreCorruption, io_counters
    root, coarse, settle = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3])
    if coarse:  # a filesystem whose timestamps tick coarsely (the probe's cached result, as such a kernel's)
        trust._FINE[os.stat(root).st_dev] = False
    trust.TRUST_AFTER_S = settle
    files, out = StageFiles(root), {}
    for ref in sys.argv[4:]:
        step, stage = ref.split(":")
        try:
            t = files.read_stage(int(step), stage)
            out[ref] = {"rows": t.num_rows, "x_sum": int(sum(map(sum, t.column("x").to_pylist())))}
        except StoreCorruption as e:
            out[ref] = {"error": str(e)}
    out["io"] = io_counters()
    print(json.dumps(out))
    """
)


def _read_in_process(root: Path, *refs: str, coarse: bool = False, settle: float = 2.0, env=None) -> dict:
    """Verified reads of ``refs`` ("step:stage") in a fresh Python process; its results and io counters."""
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", _READER, str(root), "1" if coarse else "0", str(settle), *refs],
        capture_output=True,
        text=True,
        env=run_env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(rows: int = 64, width: int = 300, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    offsets = np.arange(0, rows * width + 1, width, dtype=np.int32)
    return pa.table(
        {
            "uid": pa.array([f"u{i // 4}" for i in range(rows)]),
            "sample_idx": pa.array(np.arange(rows) % 4, pa.int32()),
            "x": pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1000, rows * width))),
        }
    )


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "run")
    yield s
    s.close()


def _x_sum(t: pa.Table) -> int:
    return int(sum(map(sum, t.column("x").to_pylist())))


def test_the_fine_ctime_probe_sees_this_filesystem_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(trust, "_FINE", {})
    assert trust.fine_ctime(tmp_path / "gone") is False and trust._FINE == {}  # a failed probe is not cached
    fine = trust.fine_ctime(tmp_path)
    assert {os.stat(tmp_path).st_dev: fine} == trust._FINE
    assert isinstance(fine, bool) and fine == trust.fine_ctime(tmp_path)  # cached
    assert list(tmp_path.iterdir()) == []
    # what the probe claims holds for a real file: a change right after a stat moves the ctime
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    moved = []
    for i in range(20):
        before = os.stat(p).st_ctime_ns
        with open(p, "r+b") as f:
            f.write(bytes([i]))
        moved.append(os.stat(p).st_ctime_ns != before)
    assert all(moved) or not fine


def test_a_second_process_trusts_the_writers_file_without_hashing_it(store):
    t = _table()
    store.write_stage(1, "generate_g0", t)
    path = store.step_dir(1) / "generate_g0.arrow"
    size = path.stat().st_size
    rec = trust.read_record(path)
    assert (
        rec is not None
        and rec["how"] == "write"
        and rec["sha256"] == store.manifest(1, "generate_g0")["sha256"]
    )
    out = _read_in_process(store.root, "1:generate_g0", "1:generate_g0")
    assert out["1:generate_g0"] == {"rows": t.num_rows, "x_sum": _x_sum(t)}
    if trust.fine_ctime(store.root):  # this machine's ext4 on Linux 6.18 has multigrain timestamps
        assert out["io"]["files_hashed"] == 0 and out["io"]["read_bytes"] == 0
        assert out["io"]["files_trusted"] == 2 and out["io"]["trusted_bytes"] == 2 * size
    else:  # coarse timestamps: a writer's fresh record proves nothing; the reader hashes it
        assert out["io"]["files_hashed"] >= 1


def test_on_coarse_timestamps_the_first_reader_of_a_settled_file_records_it_for_the_others(store):
    t = _table(seed=1)
    store.write_stage(2, "generate_g0", t)
    path = store.step_dir(2) / "generate_g0.arrow"
    size = path.stat().st_size
    fresh = _read_in_process(store.root, "2:generate_g0", coarse=True, settle=60.0)
    assert fresh["io"]["files_hashed"] == 1 and fresh["io"]["trust_records_written"] == 0  # not settled
    assert trust.read_record(path)["how"] == "write"
    wait_for(lambda: unchanged_for([path], 0.2), f"{path} to be settled (unchanged for 0.2 s)", 60)
    first = _read_in_process(store.root, "2:generate_g0", coarse=True, settle=0.2)
    assert first["io"]["files_hashed"] == 1 and first["io"]["trust_records_written"] == 1
    assert trust.read_record(path)["how"] == "read"
    second = _read_in_process(store.root, "2:generate_g0", coarse=True, settle=0.2)
    assert second["io"]["files_hashed"] == 0 and second["io"]["trusted_bytes"] == size
    assert second["2:generate_g0"] == {"rows": t.num_rows, "x_sum": _x_sum(t)}


@pytest.mark.parametrize("coarse", [False, True])
def test_a_byte_flipped_after_verification_is_caught_by_another_process(store, coarse):
    t = _table(seed=2)
    store.write_stage(3, "generate_g0", t)
    store.write_stage(
        3, "reward_g0", t.append_column("acc", pa.array([True] * t.num_rows)), base=[(3, "generate_g0")]
    )
    path = store.step_dir(3) / "generate_g0.arrow"
    if coarse:
        files = sorted(store.step_dir(3).iterdir())
        wait_for(lambda: unchanged_for(files, 0.2), "step 3's files to be settled (unchanged for 0.2 s)", 60)
    ok = _read_in_process(store.root, "3:generate_g0", coarse=coarse, settle=0.2)
    assert ok["io"]["files_hashed"] + ok["io"]["files_trusted"] == 1
    again = _read_in_process(store.root, "3:generate_g0", coarse=coarse, settle=0.2)
    assert again["io"]["files_hashed"] == 0  # verified (or written) before: trusted
    # flip one byte in place, keeping the size and even putting the old mtime back
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    out = _read_in_process(store.root, "3:generate_g0", "3:reward_g0", coarse=coarse, settle=0.2)
    assert "sha256" in out["3:generate_g0"]["error"] and "sha256" in out["3:reward_g0"]["error"]
    # the flipped file at both reads; reward_g0's own intact delta is trusted from its writer's record, or
    # (coarse timestamps) hashed, since no reader had verified it yet
    assert out["io"]["files_hashed"] == (3 if coarse else 2)
    assert out["io"]["files_trusted"] == (0 if coarse else 1)
    with pytest.raises(StoreCorruption, match="sha256"):
        StageFiles(store.root).read_stage(3, "generate_g0")


def test_a_file_rewritten_after_verification_is_caught_by_another_process(store):
    t = _table(seed=3)
    store.write_stage(4, "generate_g0", t)
    path = store.step_dir(4) / "generate_g0.arrow"
    assert _read_in_process(store.root, "4:generate_g0")["io"]["files_hashed"] <= 1
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 3] ^= 0x40
    tmp = path.with_name("other.tmp")
    tmp.write_bytes(bytes(bad))
    os.replace(tmp, path)  # same size, a new inode: the record no longer names this file
    out = _read_in_process(store.root, "4:generate_g0")
    assert "sha256" in out["4:generate_g0"]["error"] and out["io"]["files_trusted"] == 0
    path.write_bytes(good)  # the right bytes again, written in place: hashed once more, and accepted
    out = _read_in_process(store.root, "4:generate_g0")
    assert out["4:generate_g0"]["rows"] == t.num_rows and out["io"]["files_hashed"] == 1


def test_torn_forged_or_foreign_records_are_never_trusted(store, monkeypatch):
    monkeypatch.setattr(stage_io, "_VERIFIED", type(stage_io._VERIFIED)())
    t = _table(seed=4)
    store.write_stage(5, "generate_g0", t)
    path = store.step_dir(5) / "generate_g0.arrow"
    rec_path = trust.record_path(path)
    text = rec_path.read_bytes()
    reader = StageFiles(store.root)

    def hashes_on_read() -> int:
        stage_io._VERIFIED.clear()
        io_counters(reset=True)
        assert _x_sum(reader.read_stage(5, "generate_g0")) == _x_sum(t)
        return io_counters()["files_hashed"]

    for damaged in (text[: len(text) // 2], b"", b"\x00" * len(text), b"{not json"):
        rec_path.write_bytes(damaged)
        assert trust.read_record(path) is None
        assert hashes_on_read() == 1
    # a well-formed record whose text was edited (the sha256 of other bytes) fails its own check
    body = json.loads(text)
    body["sha256"] = "0" * 64
    rec_path.write_bytes(json.dumps(body).encode())
    assert trust.read_record(path) is None and hashes_on_read() == 1
    # a self-consistent record of another sha256 (another version of the stage) is not trusted for this one
    key = trust.stat_key(path.stat())
    trust.write_record(path, key, "f" * 64, time.time_ns(), True, "write")
    assert trust.read_record(path) is not None and hashes_on_read() == 1
    # nor one of another identity (a copy of the run folder, another inode)
    other = (key[0], key[1] + 1, *key[2:])
    trust.write_record(path, other, store.manifest(5, "generate_g0")["sha256"], time.time_ns(), True, "write")
    assert hashes_on_read() == 1
    # deleting the stage deletes its record
    store.delete_stage(5, "generate_g0")
    assert not rec_path.exists() and not path.exists()


def test_verify_always_hashes_at_every_read_and_a_bad_value_is_named(store, monkeypatch):
    t = _table(seed=5)
    store.write_stage(6, "generate_g0", t)
    out = _read_in_process(store.root, "6:generate_g0", "6:generate_g0", env={trust.VERIFY_ENV: "always"})
    assert out["io"]["files_hashed"] == 2 and out["io"]["files_trusted"] == 0
    monkeypatch.setattr(stage_io, "_VERIFIED", type(stage_io._VERIFIED)())
    monkeypatch.setenv(trust.VERIFY_ENV, "sometimes")
    with pytest.raises(DapoUserError, match=trust.VERIFY_ENV) as e:
        StageFiles(store.root).read_stage(6, "generate_g0")
    assert "always" in str(e.value) and "trust" in str(e.value)
    monkeypatch.setenv(trust.VERIFY_ENV, "trust")
    assert StageFiles(store.root).read_stage(6, "generate_g0").num_rows == t.num_rows


def test_unverified_reads_and_listing_ignore_records(store):
    t = _table(seed=6)
    store.write_stage(7, "replay_add_00000", t)
    assert store.committed_stages(7) == ["replay_add_00000"]
    assert trust.record_path(store.step_dir(7) / "replay_add_00000.arrow").exists()
    assert StageFiles(store.root).read_stage(7, "replay_add_00000", verify=False).equals(t)
