"""The storage probe's per-node check on real files: it reads the driver's probe, writes the node's reply and
reads every input, and names what it could not do."""

from __future__ import annotations

from dapo_core.compute.storage_probe import FIX, StorageError, _check_node, _refuse


def test_a_node_that_sees_the_folder_replies_and_reads_the_inputs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".probe-abc").write_text("abc")
    (tmp_path / "model").mkdir()
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    inputs = [str(tmp_path / "model"), str(tmp_path / "train.parquet")]
    assert _check_node(str(run), "abc", "n1", inputs) is None
    assert (run / ".probe-abc-n1").read_text() == "abc n1"


def test_each_failure_names_its_path(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    problem = _check_node(str(run), "abc", "n1", [])
    assert problem is not None and problem.startswith(
        f"cannot read the run folder's probe file {run}/.probe-abc"
    )
    (run / ".probe-abc").write_text("other")  # a folder of its own at the same path, with an older probe
    assert "reads a different" in (_check_node(str(run), "abc", "n1", []) or "")
    (run / ".probe-abc").write_text("abc")
    missing = tmp_path / "gone.parquet"
    assert (
        _check_node(str(run), "abc", "n1", [str(missing)])
        == f"cannot read {missing} (No such file or directory)"
    )
    err = _refuse({"NodeID": "f00d", "NodeManagerAddress": "10.0.0.7"}, "cannot read /x (Permission denied)")
    assert isinstance(err, StorageError)
    assert str(err).startswith(
        "Ray node f00d (10.0.0.7) cannot read /x (Permission denied): every node must see"
    )
    assert FIX in str(err)
