"""Unit tests for dapo_core.store.run_store.RunStore: ledger, stage commits, corruption detection,
re-issue."""

import json
import pickle
import re
import sqlite3

import pyarrow as pa
import pytest

from dapo_core.store import RunStore, StageNotCommitted, StoreCorruption, StoreError, schema_hash


def _table(rows=4, base=0):
    return pa.table(
        {
            "uid": pa.array([f"u{base + i}" for i in range(rows)]),
            "response_ids": pa.array([[base + i] * (i + 1) for i in range(rows)], pa.list_(pa.int32())),
            "score": pa.array([float(i) for i in range(rows)], pa.float32()),
        }
    )


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "run")
    yield s
    s.close()


# ------------------------------------------------------------------ ledger
def test_ledger_pragmas(store):
    db = sqlite3.connect(store.root / "ledger.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_put_get_merge_and_list(store):
    store.put("a1", {"is_prompt": True, "status": "pending", "global_steps": 3}, payload=b"row")
    store.put_many([("a1_0", {"min_global_steps": 1, "max_global_steps": 2}), ("a1_1", {"x": "y"}, b"p")])
    store.put("b2", {"is_prompt": True, "status": "finished", "global_steps": 1}, partition="val")
    tags, payload = store.get("a1")
    assert tags == {"is_prompt": True, "status": "pending", "global_steps": 3} and payload == b"row"
    assert store.get("a1_1") == ({"x": "y"}, b"p")
    assert store.update_tags("a1", status="running", extra=5) == 1
    tags, payload = store.get("a1")
    assert (
        tags["status"] == "running" and tags["extra"] == 5 and tags["global_steps"] == 3 and payload == b"row"
    )
    assert store.list_keys(partition="train", is_prompt=True) == ["a1"]
    assert store.list_keys(status="running") == ["a1"]
    assert store.list_keys(partition="val") == ["b2"]
    assert store.list_keys(uid="a1") == ["a1", "a1_0", "a1_1"]
    assert store.list_keys(max_global_steps=2) == ["a1_0"]  # non-indexed tag via json
    assert store.list_keys(status=["running", "finished"]) == ["a1", "b2"]
    assert store.count(partition="train") == 3 and store.count() == 4
    assert store.delete(["a1_0", "missing"]) == 1
    assert store.count(uid="a1") == 2


def test_bool_and_none_tags(store):
    store.put_many([("k1_0", {"flag": True}), ("k1_1", {"flag": False}), ("k1_2", {})])
    assert store.list_keys(flag=True) == ["k1_0"]
    assert store.list_keys(flag=False) == ["k1_1"]
    assert store.list_keys(flag=None) == ["k1_2"]


def test_key_validation(store):
    with pytest.raises(ValueError, match="must not contain '_'"):
        store.put("a_b", {"is_prompt": True, "status": "pending"})
    with pytest.raises(ValueError, match="trajectory key"):
        store.put("nounderscore", {"is_prompt": False})
    with pytest.raises(ValueError, match="prompt status"):
        store.put("abc", {"is_prompt": True, "status": "done"})
    with pytest.raises(ValueError, match="tag name"):
        store.put("abc_0", {"bad-name": 1})
    with pytest.raises(ValueError, match="JSON"):
        store.put("abc_0", {"x": object()})
    with pytest.raises(KeyError, match="nope"):
        store.get("nope")
    with pytest.raises(KeyError, match="nope"):
        store.update_tags(["nope"], status="running")


def test_put_many_is_atomic(store):
    with pytest.raises(StoreError, match="trajectory key 'bad_'"):
        store.put_many([("ok_0", {}), ("bad_", {})])
    assert store.count() == 0
    store.put("p1", {"is_prompt": True, "status": "pending"})
    with pytest.raises(KeyError):
        store.update_tags(["p1", "missing"], status="running")
    assert store.get("p1")[0]["status"] == "pending"  # rolled back


def test_reissue_inflight(store):
    for uid, status in [("p1", "pending"), ("p2", "running"), ("p3", "finished"), ("p4", "failure")]:
        store.put(
            uid, {"is_prompt": True, "status": status, "global_steps": 2, "keep": uid}, payload=uid.encode()
        )
        store.put_many([(f"{uid}_{i}", {"status": "success"}) for i in range(3)])
    store.put("p5", {"is_prompt": True, "status": "running", "global_steps": 2}, partition="val")
    store.put("p5_0", {}, partition="val")
    assert store.reissue_inflight("train", 7) == 2
    for uid in ("p1", "p2"):
        tags, payload = store.get(uid)
        assert tags == {"is_prompt": True, "status": "pending", "global_steps": 7, "keep": uid}
        assert payload == uid.encode()
        assert store.count(uid=uid) == 1  # trajectories gone
    for uid, status in [("p3", "finished"), ("p4", "failure")]:
        assert store.get(uid)[0]["status"] == status and store.get(uid)[0]["global_steps"] == 2
        assert store.count(uid=uid) == 4
    assert store.count(partition="val") == 2  # other partition untouched
    assert store.list_keys(is_prompt=True, status="pending", global_steps=7, partition="train") == [
        "p1",
        "p2",
    ]
    # nothing in flight any more except the re-issued (pending) ones: re-running re-tags them again
    store.update_tags(["p1", "p2"], status="finished")
    assert store.reissue_inflight("train", 8) == 0
    assert store.reissue_inflight("empty", 8) == 0


# ------------------------------------------------------------------ stages
def test_write_read_stage_roundtrip(store):
    t = _table()
    uri = store.write_stage(3, "generate_g0", t, meta={"gen_step": 5})
    assert uri.startswith("file://") and uri.endswith("step_000003/generate_g0.arrow")
    assert uri == store.stage_uri(3, "generate_g0")
    assert store.is_committed(3, "generate_g0")
    assert store.read_stage(3, "generate_g0").equals(t)
    assert store.read_uri(uri).equals(t)
    assert store.meta(3, "generate_g0") == {"gen_step": 5}
    man = store.manifest(3, "generate_g0")
    assert man["rows"] == 4 and man["schema_hash"] == schema_hash(t.schema)
    assert man["bytes"] == (store.step_dir(3) / "generate_g0.arrow").stat().st_size
    assert store.committed_stages(3) == ["generate_g0"]
    assert store.committed_stages(2) == [] and not store.is_committed(3, "reward_g0")
    # no temp files left behind
    assert not [p for p in store.step_dir(3).iterdir() if ".tmp-" in p.name]


def test_rewrite_and_delete_stage(store):
    store.write_stage(1, "batch", _table(2))
    store.write_stage(1, "batch", _table(5, base=10))
    assert store.read_stage(1, "batch").num_rows == 5
    store.write_stage(4, "batch", _table(1))
    assert store.committed_stages(4) == ["batch"]
    assert store.delete_stage(4, "batch")
    assert not store.is_committed(4, "batch") and store.committed_stages(4) == []
    assert store.is_committed(1, "batch")
    with pytest.raises(StageNotCommitted, match="not committed"):
        store.read_stage(4, "batch")


def test_uncommitted_file_is_not_committed(store):
    uri = store.write_stage(2, "advantage", _table())
    (store.step_dir(2) / "advantage.manifest.json").unlink()
    assert not store.is_committed(2, "advantage")
    assert store.committed_stages(2) == []
    with pytest.raises(StageNotCommitted):
        store.read_uri(uri)


def test_corruption_detected(store):
    store.write_stage(0, "reward_g0", _table(50))
    path = store.step_dir(0) / "reward_g0.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.is_committed(0, "reward_g0")  # same size: only the checksum can tell
    with pytest.raises(StoreCorruption, match="sha256"):
        store.read_stage(0, "reward_g0")
    with pytest.raises(StoreCorruption):
        store.read_uri(store.stage_uri(0, "reward_g0"))
    path.write_bytes(bytes(data[:-10]))  # truncated
    assert not store.is_committed(0, "reward_g0")
    with pytest.raises(StoreCorruption, match="bytes"):
        store.read_stage(0, "reward_g0")
    (store.step_dir(0) / "reward_g0.manifest.json").write_text("{not json")
    with pytest.raises(StoreCorruption, match="unreadable"):
        store.read_stage(0, "reward_g0")


def test_stage_and_step_validation(store):
    for bad in ("Gen", "gen-0", "", "a/b", "../x"):
        with pytest.raises(ValueError, match="stage name"):
            store.write_stage(0, bad, _table())
    with pytest.raises(ValueError, match="step"):
        store.write_stage(-1, "gen", _table())
    with pytest.raises(ValueError, match=re.escape("pyarrow.Table")):
        store.write_stage(0, "gen", {"a": [1]})


def test_run_json_files_and_pickle(store, tmp_path):
    store.write_json("config.json", {"a": {"b": 1}})
    assert store.read_json("config.json") == {"a": {"b": 1}}
    assert store.read_json("state.json", default=None) is None
    with pytest.raises(FileNotFoundError, match=re.escape("state.json")):
        store.read_json("state.json")
    with pytest.raises(StoreError):
        store.write_json("../escape.json", {})
    store.put("z9", {"is_prompt": True, "status": "pending"})
    clone = pickle.loads(pickle.dumps(store))
    assert clone.root == store.root and clone.get("z9")[0]["status"] == "pending"
    clone.close()
    assert json.loads((store.root / "config.json").read_text()) == {"a": {"b": 1}}


def test_read_uri_refuses_a_file_outside_the_run_folder(store, tmp_path):
    other = RunStore(tmp_path / "other")
    uri = other.write_stage(1, "gen", _table())
    other.close()
    with pytest.raises(StoreError, match="is not a stage file of the run folder"):
        store.read_uri(uri)
    with pytest.raises(StoreError, match="is not a stage file of the run folder"):
        store.read_uri("memory://dapo-test/free.arrow")
