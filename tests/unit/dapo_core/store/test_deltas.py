"""Column-delta stage files: each stage writes only what it adds; reads assemble the view by aligned row
order with an id check; deleting or rewriting a base deletes what was built on it; a manifest of an older
format is refused, naming the file and the fix."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dapo_core.store import RunStore, StoreCorruption, StoreError
from dapo_core.store.deltas import _contiguous
from dapo_core.store.manifests import FORMAT, base_refs
from dapo_core.store.stage_files import KEY_COLUMN, SRC_COLUMN, StageFiles, io_counters


def _prompts(groups: int, n: int = 4, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    uids = [f"{seed:02d}{g:030x}" for g in range(groups) for _ in range(n)]
    return pa.table(
        {
            "uid": pa.array(uids, pa.string()),
            "sample_idx": pa.array([i % n for i in range(groups * n)], pa.int64()),
            "prompt_ids": pa.array(
                [rng.integers(0, 100, 40).tolist() for _ in range(groups * n)], pa.list_(pa.int32())
            ),
        }
    )


def _add(table: pa.Table, name: str, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    col = pa.array(
        [rng.random(30).astype("float32").tolist() for _ in range(table.num_rows)], pa.list_(pa.float32())
    )
    return table.append_column(name, col)


@pytest.fixture
def store(tmp_path):
    with RunStore(tmp_path / "run") as s:
        yield s


def _file_columns(store: RunStore, step: int, stage: str) -> list[str]:
    path = store.step_dir(step) / f"{stage}.arrow"
    return pa.ipc.open_file(pa.memory_map(str(path))).schema.names


def test_aligned_delta_holds_only_new_columns_and_reads_back_whole(store):
    p = _prompts(8)
    u0 = store.write_stage(1, "prompts_g0", p)
    g = _add(p, "response_ids", 1)
    u1 = store.write_stage(1, "generate_g0", g, base=u0)
    r = _add(g, "reward", 2)
    store.write_stage(1, "reward_g0", r, base=u1)
    assert _file_columns(store, 1, "generate_g0") == [KEY_COLUMN, "response_ids"]
    assert _file_columns(store, 1, "reward_g0") == [KEY_COLUMN, "reward"]
    assert store.read_stage(1, "reward_g0").equals(r)
    assert store.read_uri(store.stage_uri(1, "generate_g0")).equals(g)
    assert base_refs(store.manifest(1, "reward_g0")) == [(1, "generate_g0")]


def test_selection_and_multi_base_concat(store):
    r0 = _add(_prompts(6, seed=1), "acc", 3)
    r1 = _add(_prompts(6, seed=2), "acc", 4)
    u0 = store.write_stage(2, "reward_g0", r0)
    u1 = store.write_stage(2, "reward_g1", r1)
    kept0 = r0.filter(pc.is_in(r0.column("uid"), value_set=pa.array(r0.column("uid").to_pylist()[4:16])))
    k0 = store.write_stage(2, "kept_g0", kept0, base=u0)
    k1 = store.write_stage(2, "kept_g1", r1, base=u1)
    assert _file_columns(store, 2, "kept_g0") == [KEY_COLUMN, SRC_COLUMN]
    both = pa.concat_tables([kept0, r1])
    batch = both.take(pa.array(np.random.default_rng(0).permutation(both.num_rows)[:20]))
    store.write_stage(2, "batch", batch, base=[k0, k1])
    assert _file_columns(store, 2, "batch") == [KEY_COLUMN, SRC_COLUMN]
    assert store.read_stage(2, "batch").equals(batch)
    assert store.read_stage(2, "kept_g0").equals(kept0)


def test_changed_column_is_written_and_new_rows_fall_back_to_a_whole_file(store):
    p = _prompts(4)
    u0 = store.write_stage(1, "prompts_g0", p)
    changed = p.set_column(2, "prompt_ids", pa.array([[1, 2]] * p.num_rows, pa.list_(pa.int32())))
    store.write_stage(1, "edited", changed, base=u0)
    assert "prompt_ids" in _file_columns(store, 1, "edited")
    assert store.read_stage(1, "edited").equals(changed)
    other = _prompts(4, seed=9)  # rows not in the base: stored whole
    store.write_stage(1, "other", other, base=u0)
    assert base_refs(store.manifest(1, "other")) == [] and store.read_stage(1, "other").equals(other)


def test_delete_and_rewrite_of_a_base_remove_what_was_built_on_it(store):
    p = _prompts(4)
    u0 = store.write_stage(1, "prompts_g0", p)
    u1 = store.write_stage(1, "generate_g0", _add(p, "response_ids", 1), base=u0)
    store.write_stage(1, "reward_g0", _add(_add(p, "response_ids", 1), "reward", 2), base=u1)
    store.delete_stage(1, "generate_g0")
    assert store.committed_stages(1) == ["prompts_g0"]
    assert not (store.step_dir(1) / "reward_g0.arrow").exists()
    u1 = store.write_stage(1, "generate_g0", _add(p, "response_ids", 1), base=u0)
    store.write_stage(1, "reward_g0", _add(_add(p, "response_ids", 1), "reward", 2), base=u1)
    store.write_stage(1, "prompts_g0", p)  # rewriting a base un-commits its dependents first
    assert store.committed_stages(1) == ["prompts_g0"]


def test_base_missing_or_replaced_behind_the_stores_back(store):
    p = _prompts(4)
    u0 = store.write_stage(1, "prompts_g0", p)
    store.write_stage(1, "generate_g0", _add(p, "response_ids", 1), base=u0)
    (store.step_dir(1) / "prompts_g0.manifest.json").unlink()  # base lost: the delta is not committed
    assert not store.is_committed(1, "generate_g0")
    store.write_stage(1, "prompts_g0", _prompts(4, seed=5))
    store.write_stage(1, "generate_g0", _add(p, "response_ids", 1), base=u0)  # seed-0 rows over seed-5 rows
    assert (
        base_refs(store.manifest(1, "generate_g0")) == []
    )  # the rows are not the base's, so it was stored whole
    raw = StageFiles(store.root)
    man = json.loads((store.step_dir(1) / "generate_g0.manifest.json").read_text())
    assert man["format"] == FORMAT and raw.read_stage(1, "generate_g0").equals(_add(p, "response_ids", 1))


def test_key_mismatch_is_corruption(store, tmp_path):
    p = _prompts(4)
    u0 = store.write_stage(1, "prompts_g0", p)
    store.write_stage(1, "generate_g0", _add(p, "response_ids", 1), base=u0)
    other = RunStore(tmp_path / "other")  # write different rows as prompts_g0 without the cascade
    other.write_stage(1, "prompts_g0", _prompts(4, seed=7))
    for suffix in (".arrow", ".manifest.json"):
        (store.step_dir(1) / f"prompts_g0{suffix}").write_bytes(
            (other.step_dir(1) / f"prompts_g0{suffix}").read_bytes()
        )
    other.close()
    with pytest.raises(StoreCorruption, match="row ids do not match"):
        store.read_stage(1, "generate_g0")


def test_a_manifest_of_an_older_format_is_refused_naming_the_file_and_the_fix(store):
    """Formats 1 (whole tables, no ``format`` key) and 2 (column deltas without ``encoded``) are not read."""
    p = _prompts(4)
    store.write_stage(1, "prompts_g0", p)
    store.write_stage(1, "generate_g0", _add(p, "response_ids", 1), base=store.stage_uri(1, "prompts_g0"))
    man_path = store.step_dir(1) / "prompts_g0.manifest.json"
    man = json.loads(man_path.read_text())
    for old in (1, 2, None):
        if old is None:
            man.pop("format")  # format 1 wrote no format key
        else:
            man["format"] = old
        man_path.write_text(json.dumps(man))
        for read in (
            lambda: StageFiles(store.root).read_stage(1, "prompts_g0"),
            lambda: StageFiles(store.root).read_stage(1, "generate_g0"),  # its base is refused
        ):
            with pytest.raises(
                StoreError, match=f"manifest format {old or 1}, older than this code reads"
            ) as e:
                read()
            assert "prompts_g0.manifest.json" in str(e.value) and "start a new run" in str(e.value)
            assert "\n" not in str(e.value)


def test_projection_reads_only_the_files_it_needs(store):
    p = _prompts(8)
    u0 = store.write_stage(1, "prompts_g0", p)
    u1 = store.write_stage(1, "generate_g0", _add(p, "response_ids", 1), base=u0)
    store.write_stage(1, "reward_g0", _add(_add(p, "response_ids", 1), "reward", 2), base=u1)
    io_counters(reset=True)
    t = store.read_stage(1, "reward_g0", columns=["uid", "reward"])
    assert t.column_names == ["uid", "reward"] and t.num_rows == p.num_rows
    assert io_counters()["files_read"] == 2  # prompts (uid) and reward, not generate


def test_bytes_written_per_step_close_to_unique_bytes(store):
    """A step's chain written as deltas costs at most 1.3x the bytes the step adds."""
    p = _prompts(64, n=8)
    u = store.write_stage(1, "prompts_g0", p)
    t = p
    unique = p.nbytes
    for i, name in enumerate(("generate_g0", "reward_g0", "old_log_prob", "advantage")):
        new = _add(t, f"col_{name}", i)
        unique += new.column(f"col_{name}").nbytes
        u = store.write_stage(1, name, new, base=u)
        t = new
    written = sum(f.stat().st_size for f in store.step_dir(1).glob("*.arrow"))
    assert written <= 1.3 * unique, (written, unique)
    assert store.read_stage(1, "advantage").equals(t)


def test_write_selection_reads_only_row_ids(store):
    r0 = _add(_prompts(6, seed=1), "response_ids", 3)
    r1 = _add(_prompts(6, seed=2), "response_ids", 4)
    u0 = store.write_stage(3, "kept_g0", r0)
    u1 = store.write_stage(3, "kept_g1", r1)
    positions = np.random.default_rng(1).permutation(48)[:20]
    io_counters(reset=True)
    store.write_selection(3, "batch", positions, base=[u0, u1], meta={"why": "test"})
    c = io_counters()
    assert c["read_bytes"] == 0 and c["mapped_bytes"] == 0  # no data read whole, nothing but ids mapped
    assert _file_columns(store, 3, "batch") == [KEY_COLUMN, SRC_COLUMN]
    want = pa.concat_tables([r0, r1]).take(pa.array(positions))
    assert store.read_stage(3, "batch").equals(want)
    assert store.meta(3, "batch") == {"why": "test"}
    lengths = store.read_lengths(store.stage_uri(3, "batch"), ["prompt_ids", "response_ids"])
    assert lengths.column("response_ids").to_pylist() == [30] * 20
    assert lengths.column("uid").equals(want.column("uid"))
    with pytest.raises(Exception, match="positions must lie"):
        store.write_selection(3, "bad", [48], base=[u0, u1])


def test_contiguous_selections_read_as_slices_and_equal_a_take(store):
    r0 = _add(_prompts(6, seed=1), "response_ids", 3)
    r1 = _add(_prompts(6, seed=2), "response_ids", 4)
    u0 = store.write_stage(3, "kept_g0", r0)
    u1 = store.write_stage(3, "kept_g1", r1)
    both = pa.concat_tables([r0, r1])
    for name, positions in (("whole", np.arange(48)), ("middle", np.arange(5, 30)), ("one", [47])):
        store.write_selection(3, f"batch_{name}", positions, base=[u0, u1])
        back = StageFiles(store.root).read_stage(3, f"batch_{name}")
        assert back.equals(both.take(pa.array(positions))), name
    store.write_selection(3, "batch_gap", [0, 1, 3], base=[u0, u1])
    assert StageFiles(store.root).read_stage(3, "batch_gap").equals(both.take(pa.array([0, 1, 3])))
    assert _contiguous(pa.chunked_array([[5, 6], [7]])) == (5, 3)
    assert _contiguous(pa.array([0, 1, 3])) is None and _contiguous(pa.array([2, 1])) is None
    assert _contiguous(pa.array([], pa.int64())) is None
