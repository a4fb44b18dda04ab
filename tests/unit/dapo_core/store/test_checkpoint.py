"""Unit tests for dapo_core.store.checkpoint.CheckpointDir: atomic save, verify, latest pointer, retention."""

import json
import re

import pytest

from dapo_core.store import RunStore
from dapo_core.store.checkpoint import CheckpointDir, CheckpointError


def _writer(payload: bytes):
    def write(d):
        (d / "model.safetensors").write_bytes(payload)
        (d / "optim").mkdir()
        (d / "optim" / "state.pt").write_bytes(payload[::-1] + b"!")

    return write


def test_save_layout_manifest_and_latest(tmp_path):
    ck = CheckpointDir(tmp_path)
    assert ck.latest_step() is None
    path = ck.save(5, _writer(b"weights-5"), meta={"gen_step": 9})
    assert path == tmp_path / "ckpt" / "step_5" and path.is_dir()
    man = json.loads((path / "MANIFEST.json").read_text())
    assert man["meta"] == {"gen_step": 9, "step": 5}
    assert set(man["files"]) == {"model.safetensors", "optim/state.pt"}
    assert man["files"]["model.safetensors"]["bytes"] == len(b"weights-5")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "5"
    assert ck.latest_step() == 5 and ck.load() == path and ck.meta(5)["gen_step"] == 9
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".tmp-")]


def test_verify_names_the_bad_file(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.save(1, _writer(b"abcdef"))
    f = ck.path(1) / "model.safetensors"
    f.write_bytes(b"abcdeX")
    with pytest.raises(CheckpointError, match=re.escape("'model.safetensors' is corrupted")):
        ck.verify(1)
    ck.verify(1, checksum=False)  # same size: passes without checksum
    f.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match=re.escape("'model.safetensors' has the wrong size")):
        ck.load(1)
    (ck.path(1) / "optim" / "state.pt").unlink()
    f.write_bytes(b"abcdef")
    with pytest.raises(CheckpointError, match=re.escape("'optim/state.pt' is missing")):
        ck.load()
    with pytest.raises(CheckpointError, match=re.escape("MANIFEST.json is missing")):
        ck.verify(2)


def test_failed_write_fn_leaves_nothing(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.save(1, _writer(b"one"))

    def boom(d):
        (d / "half").write_bytes(b"x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ck.save(2, boom)
    assert ck.latest_step() == 1 and not ck.path(2).exists()
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".tmp")] == []


def test_stale_tmp_dirs_cleaned_on_open(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.save(3, _writer(b"x"))
    stale = tmp_path / "ckpt" / ".tmp-step_4-abcd1234"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    ck2 = CheckpointDir(tmp_path)
    assert ck2.cleaned_tmp == 1 and not stale.exists() and ck2.latest_step() == 3


def test_resave_and_overwrite(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.save(1, _writer(b"one"))
    # a step dir left by a crash before `latest` moved is replaced silently
    ck.save(2, _writer(b"two-a"))
    (tmp_path / "ckpt" / "latest").write_text("1\n")
    ck.save(2, _writer(b"two-b"))
    assert ck.latest_step() == 2 and (ck.path(2) / "model.safetensors").read_bytes() == b"two-b"
    with pytest.raises(CheckpointError, match="overwrite=True"):
        ck.save(2, _writer(b"two-c"))
    ck.save(2, _writer(b"two-c"), overwrite=True)
    assert (ck.load(2) / "model.safetensors").read_bytes() == b"two-c"
    # saving an older step never moves `latest` backwards
    ck.save(0, _writer(b"zero"))
    assert ck.latest_step() == 2


def test_keep_last_never_deletes_latest(tmp_path):
    ck = CheckpointDir(tmp_path)
    for s in (1, 2, 3, 4):
        ck.save(s, _writer(str(s).encode()))
    assert ck.keep_last(2) == [1, 2]
    assert ck.steps() == [3, 4]
    (tmp_path / "ckpt" / "latest").write_text("3\n")
    ck.save(5, _writer(b"5"))
    (tmp_path / "ckpt" / "latest").write_text("3\n")  # pretend 5 was never pointed at
    assert ck.keep_last(1) == [4] and ck.steps() == [3, 5]
    with pytest.raises(CheckpointError):
        ck.keep_last(0)


def test_errors(tmp_path):
    ck = CheckpointDir(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ck.load()
    with pytest.raises(CheckpointError, match="reserved"):
        ck.save(1, lambda d: (d / "MANIFEST.json").write_text("{}"))
    with pytest.raises(CheckpointError, match="non-negative"):
        ck.path(-1)
    (tmp_path / "ckpt" / "latest").write_text("garbage")
    with pytest.raises(CheckpointError, match="not a step number"):
        ck.latest_step()


def test_run_store_exposes_checkpoints(tmp_path):
    store = RunStore(tmp_path / "run")
    store.checkpoints.save(7, _writer(b"w"))
    assert store.checkpoints.latest_step() == 7
    assert (tmp_path / "run" / "ckpt" / "step_7" / "MANIFEST.json").exists()
    store.close()


def test_rewind_makes_an_earlier_step_the_latest_and_keeps_the_abandoned_branch(tmp_path):
    from dapo_core.store.checkpoint import CheckpointDir

    ckpts = CheckpointDir(tmp_path)
    for step in (1, 2, 3):
        ckpts.save(step, lambda d, s=step: (d / "w.txt").write_text(str(s)))
    assert ckpts.latest_step() == 3
    assert ckpts.rewind(1) == [2, 3]
    assert ckpts.latest_step() == 1 and ckpts.steps() == [1]
    assert sorted(p.name for p in next(tmp_path.joinpath("ckpt").glob("abandoned-*")).iterdir()) == [
        "step_2",
        "step_3",
    ]
    ckpts.save(2, lambda d: (d / "w.txt").write_text("new 2"))  # the new branch saves step 2 again
    assert ckpts.latest_step() == 2 and (ckpts.load(2) / "w.txt").read_text() == "new 2"
    assert ckpts.rewind(0) == [1, 2] and ckpts.latest_step() is None  # no step_0 here: no pointer
