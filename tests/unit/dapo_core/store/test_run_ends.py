"""Run-length ends (manifest format 3): per-token columns of the form ``[b, …, b, e]`` per row are stored as
one ``(n, body, last)`` per row and read back bit for bit; other columns are stored as they are; a flipped
byte is still caught; a manifest of another format is refused. Verified once per process: a
file hashed when settled is taken on trust while unchanged, and a changed one is hashed again."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest

from dapo_core.stages import compute_advantage_table
from dapo_core.store import RunStore, StoreCorruption, StoreError, stage_io, trust
from dapo_core.store.manifests import FORMAT
from dapo_core.store.run_ends import ENDS
from dapo_core.store.stage_files import StageFiles, io_counters
from tests.helpers import unchanged_for, wait_for


@pytest.fixture
def store(tmp_path):
    with RunStore(tmp_path / "run") as s:
        yield s


def _lists(lengths, values: np.ndarray, vtype: pa.DataType) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, vtype))


def _batch(groups: int = 6, n: int = 4, seed: int = 0) -> pa.Table:
    """A generate-stage-shaped table (the columns the advantage stage reads), response lengths 0..40."""
    rng = np.random.default_rng(seed)
    rows = groups * n
    lens = rng.integers(1, 40, rows)
    lens[3] = 0  # an empty response
    tokens = int(lens.sum())
    return pa.table(
        {
            "uid": pa.array([f"{seed:02d}{g:030x}" for g in range(groups) for _ in range(n)]),
            "sample_idx": pa.array(np.tile(np.arange(n), groups), pa.int32()),
            "prompt_ids": _lists(
                np.full(rows, 5), rng.integers(3, 90, rows * 5).astype(np.int32), pa.int32()
            ),
            "response_ids": _lists(lens, rng.integers(3, 90, tokens).astype(np.int32), pa.int32()),
            "rollout_log_probs": _lists(lens, -rng.random(tokens).astype(np.float32), pa.float32()),
            "old_log_probs": _lists(lens, -rng.random(tokens).astype(np.float32), pa.float32()),
            "reward": pa.array(rng.choice([-1.0, 1.0], rows).astype(np.float32)),
        }
    )


def _bits(table: pa.Table, name: str) -> np.ndarray:
    values = table.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return values.view(f"u{values.itemsize}")


def test_grpo_advantage_columns_are_stored_as_ends_and_read_back_bitwise(store):
    batch = _batch()
    adv, _ = compute_advantage_table(batch, pad_token_id=0, adv_estimator="grpo")
    u = store.write_stage(1, "old_log_prob", batch)
    store.write_stage(1, "advantage", adv, base=u)
    man = store.manifest(1, "advantage")
    assert man["format"] == FORMAT == 3
    assert man["encoded"] == dict.fromkeys(
        ("token_level_rewards", "advantages", "returns", "response_mask"), ENDS
    )
    # n + body + last per row (4 + 2 x 4 bytes for float32) instead of 4 bytes a token plus offsets
    raw = pa.ipc.open_file(pa.memory_map(str(store.step_dir(1) / "advantage.arrow"))).read_all()
    for c in man["encoded"]:
        width = adv.column(c).type.value_type.byte_width
        assert pa.types.is_struct(raw.column(c).type) and raw.column(c).nbytes == adv.num_rows * (
            4 + 2 * width
        )
    assert sum(raw.column(c).nbytes for c in man["encoded"]) < 0.3 * sum(
        adv.column(c).nbytes for c in man["encoded"]
    )
    assert store.manifest(1, "old_log_prob")["encoded"] == {}  # ids and log-probs vary within a row
    for reader in (store, StageFiles(store.root)):  # the writer's cache, then a fresh process's view
        for verify in (True, False):
            back = reader.read_stage(1, "advantage", verify=verify)
            assert back.schema == adv.schema and back.equals(adv)
            for c in man["encoded"]:
                assert np.array_equal(_bits(back, c), _bits(adv, c)), c
    part = StageFiles(store.root).read_stage(1, "advantage", verify=False, columns=["uid", "advantages"])
    assert part.equals(adv.select(["uid", "advantages"]))
    lengths = StageFiles(store.root).read_lengths((1, "advantage"), ["response_mask", "response_ids"])
    assert lengths.column("response_mask").equals(lengths.column("response_ids"))


def test_ends_keep_every_bit_and_leave_other_columns_alone(store):
    lens = np.array([5, 1, 0, 3, 7, 2, 4, 6])
    tokens = int(lens.sum())
    ends = np.cumsum(lens)

    def ends_values(body, last, dtype):
        v = np.repeat(np.asarray(body, dtype), lens)
        v[ends[lens > 0] - 1] = np.asarray(last, dtype)[lens > 0]
        return v

    nan_payload = np.array([0x7FC00001], np.uint32).view(np.float32)[0]
    body_f = np.array([-0.0, 1.5, 0.0, np.inf, -np.inf, nan_payload, 3.25, -0.0], np.float32)
    last_f = np.array([nan_payload, 2.0, 0.0, -0.0, 7.0, 1e-45, -3.25, 0.0], np.float32)
    i64 = np.iinfo(np.int64)
    table = pa.table(
        {
            "f32": _lists(lens, ends_values(body_f, last_f, np.float32), pa.float32()),
            "f64": _lists(lens, ends_values(body_f, body_f, np.float64), pa.float64()),
            "i64": _lists(lens, ends_values([i64.min] * 8, [i64.max] * 8, np.int64), pa.int64()),
            "i8": _lists(lens, np.ones(tokens, np.int8), pa.int8()),
            "varies": _lists(lens, np.arange(tokens, dtype=np.float32), pa.float32()),  # not [b..b, e]
            "with_null": pa.array([[1.0] * k if k != 3 else None for k in lens], pa.list_(pa.float32())),
            "not_null_items": pa.array(
                [[2] * k for k in lens], pa.list_(pa.field("item", pa.int32(), nullable=False))
            ),
            "large": pa.array([[2] * k for k in lens], pa.large_list(pa.int32())),
            "flag": pa.array([[True] * k for k in lens], pa.list_(pa.bool_())),
        },
        metadata={"who": "test"},
    )
    table = table.cast(table.schema.set(0, table.schema.field("f32").with_metadata({"unit": "nat"})))
    store.write_stage(2, "enc", table)
    man = store.manifest(2, "enc")
    assert man["encoded"] == {"f32": ENDS, "f64": ENDS, "i64": ENDS, "i8": ENDS}
    back = StageFiles(store.root).read_stage(2, "enc")
    assert back.schema.equals(table.schema, check_metadata=True)
    for name in ("f32", "f64", "i64", "i8", "varies", "not_null_items", "large"):
        assert np.array_equal(_bits(back, name), _bits(table, name)), name
        assert back.column(name).type == table.column(name).type
    assert back.column("with_null").equals(table.column("with_null"))
    assert back.column("flag").equals(table.column("flag"))
    # the file holds the structs, not the lists
    schema = pa.ipc.open_file(pa.memory_map(str(store.step_dir(2) / "enc.arrow"))).schema
    assert pa.types.is_struct(schema.field("f32").type) and schema.field("f32").metadata == {b"unit": b"nat"}
    assert pa.types.is_list(schema.field("varies").type)


def test_flipped_byte_in_an_encoded_file_is_caught(store):
    adv, _ = compute_advantage_table(_batch(groups=20), pad_token_id=0, adv_estimator="grpo")
    store.write_stage(0, "advantage", adv)
    assert store.manifest(0, "advantage")["encoded"]
    path = store.step_dir(0) / "advantage.arrow"
    clean = path.read_bytes()
    for pos in (len(clean) // 3, len(clean) // 2, len(clean) - 200):
        data = bytearray(clean)
        data[pos] ^= 0x01
        path.write_bytes(bytes(data))
        assert store.is_committed(0, "advantage")  # same size: only the checksum can tell
        with pytest.raises(StoreCorruption, match="sha256"):
            StageFiles(store.root).read_stage(0, "advantage")
        with pytest.raises(StoreCorruption, match="sha256"):
            store.verify_stage(0, "advantage")
    path.write_bytes(clean)
    assert StageFiles(store.root).read_stage(0, "advantage").equals(adv)


def test_bad_encoded_entries_are_corruption(store):
    adv, _ = compute_advantage_table(_batch(), pad_token_id=0, adv_estimator="grpo")
    store.write_stage(0, "advantage", adv)
    man_path = store.step_dir(0) / "advantage.manifest.json"
    man = json.loads(man_path.read_text())
    man["encoded"]["advantages"] = "zigzag"
    man_path.write_text(json.dumps(man))
    with pytest.raises(StoreCorruption, match="unknown encoding 'zigzag'"):
        StageFiles(store.root).read_stage(0, "advantage")
    man["encoded"] = {"uid": ENDS}
    man_path.write_text(json.dumps(man))
    with pytest.raises(StoreCorruption, match="'uid' is marked run-length encoded"):
        StageFiles(store.root).read_stage(0, "advantage")


def test_a_manifest_of_another_format_is_refused_naming_the_file_and_the_fix(store):
    """A format-2 folder (column deltas without run-length ends) and a newer format are both refused."""
    batch = _batch(seed=3)
    store.write_stage(4, "generate_g0", batch)
    man_path = store.step_dir(4) / "generate_g0.manifest.json"
    man = json.loads(man_path.read_text())
    for fmt, says, fix in (
        (2, "older than this code reads", "start a new run"),
        (FORMAT + 1, "newer than this code reads", "upgrade this checkout"),
    ):
        man_path.write_text(json.dumps({**man, "format": fmt}))
        with pytest.raises(StoreError, match=rf"manifest format {fmt}, {says} \({FORMAT}\)") as e:
            StageFiles(store.root).read_stage(4, "generate_g0")
        assert fix in str(e.value) and "generate_g0.manifest.json" in str(e.value)


def test_a_settled_file_is_hashed_once_per_process_and_any_change_is_hashed_again(store, monkeypatch):
    """On a filesystem with coarse timestamps (the fine-ctime probe's cached result set to False, as on a
    kernel without multigrain timestamps) only a file settled when hashed is trusted afterwards."""
    monkeypatch.setattr(stage_io, "_VERIFIED", type(stage_io._VERIFIED)())
    monkeypatch.setitem(trust._FINE, os.stat(store.root).st_dev, False)
    monkeypatch.setattr(trust, "TRUST_AFTER_S", 60.0)
    batch = _batch(groups=10)
    u = store.write_stage(5, "generate_g0", batch)
    store.write_stage(5, "reward_g0", batch.append_column("acc", pa.array([True] * batch.num_rows)), base=u)
    path = store.step_dir(5) / "generate_g0.arrow"
    size = path.stat().st_size
    reader = StageFiles(store.root)
    io_counters(reset=True)
    reader.read_stage(5, "generate_g0")  # written just now: hashed, and not trusted later
    reader.read_stage(5, "generate_g0")
    assert io_counters()["read_bytes"] == 2 * size and io_counters()["trusted_bytes"] == 0
    monkeypatch.setattr(trust, "TRUST_AFTER_S", 0.05)
    wait_for(lambda: unchanged_for([path], 0.05), f"{path} to be settled (unchanged for 0.05 s)", 60)
    io_counters(reset=True)
    reader.read_stage(5, "generate_g0")  # settled: hashed once more, then trusted
    back = reader.read_stage(5, "reward_g0")  # its base generate_g0 is taken on trust
    c = io_counters()
    assert c["trusted_bytes"] == size and c["read_bytes"] == size + store.manifest(5, "reward_g0")["bytes"]
    assert back.drop_columns(["acc"]).equals(batch)
    # a flipped byte moves the ctime: hashed again and caught, even right after the trusted read
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(StoreCorruption, match="sha256"):
        reader.read_stage(5, "generate_g0")
    with pytest.raises(StoreCorruption, match="sha256"):
        reader.read_stage(5, "reward_g0")
    # replaced by another file of the same size and content hash mismatch (a new inode): hashed again
    data[len(data) // 2] ^= 0x10
    tmp = path.with_name("gen.tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)
    io_counters(reset=True)
    assert reader.read_stage(5, "generate_g0").equals(batch)
    assert io_counters()["trusted_bytes"] == 0
    assert reader.read_stage(5, "generate_g0", verify=False).equals(batch)


def test_large_buffers_hashed_beside_the_write_give_the_files_sha256(store):
    import hashlib

    rng = np.random.default_rng(4)
    rows, width = 256, 2048  # 2 MiB per-token columns: each buffer is hashed on the helper thread
    offsets = np.arange(0, rows * width + 1, width, dtype=np.int32)
    table = pa.table(
        {
            "x": pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.random(rows * width, np.float32))),
            "y": pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(rng.integers(0, 9, rows * width, np.int32))
            ),
        }
    )
    assert table.column("x").nbytes > 2 * stage_io._OVERLAP_MIN
    store.write_stage(0, "big", table)
    data = (store.step_dir(0) / "big.arrow").read_bytes()
    assert store.manifest(0, "big")["sha256"] == hashlib.sha256(data).hexdigest()
    assert StageFiles(store.root).read_stage(0, "big").equals(table)

    class Full:
        def write(self, mv):
            raise OSError(28, "No space left on device")

    sink = stage_io._HashingSink(Full())
    with pytest.raises(OSError, match="No space"):
        sink.write(bytearray(4 * stage_io._OVERLAP_MIN))
    assert sink.nbytes == 0
