"""Trust in the run store and checkpoints: nothing read from disk executes, every checkpoint load
path verifies, a lost `latest` pointer or ledger is never a silent restart, and a full disk leaves the store
consistent with a message naming the path."""

from __future__ import annotations

import errno
import json
import pickle
import random

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.models import build_tiny_model
from dapo_core.errors import DapoUserError
from dapo_core.seeding import get_rng_state, set_rng_state
from dapo_core.store import RunStore, StoreError
from dapo_core.store import files as store_files
from dapo_core.store.checkpoint import CheckpointDir, CheckpointError, enclosing_checkpoint, verify_folder
from dapo_core.store.files import DiskFull
from dapo_core.store.state_files import StateFileError, load_state, refuse_unsafe_pickles, save_state
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

OPTIM = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "lr_warmup_steps": 2}


class _RunsCode:
    """Pickling this object makes unpickling create `marker` (what a crafted checkpoint file would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _writer(files: dict[str, bytes]):
    def write(d):
        for name, data in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)

    return write


# ----------------------------------------------------------------------------- state files (no pickle)
def test_state_files_round_trip_optimizer_and_rng_exactly(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    rng = get_rng_state()
    save_state(tmp_path, "optim", opt.state_dict())
    save_state(tmp_path, "extra", {"rng": rng, "odd": {1: (float("inf"), None)}, "x": np.float32(0.5)})
    after = (random.random(), np.random.rand(), torch.rand(1))
    back = load_state(tmp_path, "extra")
    set_rng_state(back["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == after
    assert back["odd"] == {1: (float("inf"), None)} and back["x"] == 0.5
    o = load_state(tmp_path, "optim")
    assert o["param_groups"][0]["betas"] == (0.9, 0.99)
    for k, st in opt.state_dict()["state"].items():
        assert all(torch.equal(st[n], o["state"][k][n]) for n in st)
    assert not list(tmp_path.glob("*.safetensors")), "state files must not look like model weights"


def test_state_files_refuse_what_would_need_pickle(tmp_path):
    with pytest.raises(StateFileError, match=r"extra\.obj.*object"):
        save_state(tmp_path, "extra", {"obj": object()})


def test_crafted_state_files_never_execute(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_RunsCode(str(marker)))
    (tmp_path / "extra.json").write_text(json.dumps({"format": "dapo-state/1", "tree": {}}))
    (tmp_path / "extra.tensors").write_bytes(payload)  # a pickle where safetensors should be
    with pytest.raises(StateFileError, match="not a readable safetensors"):
        load_state(tmp_path, "extra")
    (tmp_path / "extra.json").write_bytes(payload)  # and a pickle where the JSON should be
    with pytest.raises(StateFileError, match="not valid JSON"):
        load_state(tmp_path, "extra")
    assert not marker.exists()


def test_third_party_pickles_are_checked_with_the_restricted_unpickler(tmp_path):
    """DeepSpeed unpickles its own files in full: torch's weights_only unpickler checks them first."""
    marker = tmp_path / "pwned"
    ds = tmp_path / "deepspeed" / "state"
    ds.mkdir(parents=True)
    torch.save({"w": torch.ones(2), "step": 3, "betas": (0.9, 0.99)}, ds / "optim_states.pt")
    assert refuse_unsafe_pickles(tmp_path / "deepspeed") == [ds / "optim_states.pt"]
    torch.save({"w": torch.ones(2), "evil": _RunsCode(str(marker))}, ds / "model_states.pt")
    with pytest.raises(StateFileError, match=r"model_states\.pt.*could run code") as ei:
        refuse_unsafe_pickles(tmp_path / "deepspeed")
    assert "Fix:" in str(ei.value) and not marker.exists()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_model_cfg(hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), cfg, seed=1)


def test_engine_refuses_pickled_checkpoint_without_running_it(tiny_dir, tmp_path):
    """The issue's exploit: a crafted extra_state.pt (manifest updated to match) ran code on resume."""
    eng = make_train_engine("torch", tiny_dir, OPTIM, total_steps=4, grad_clip=1.0)
    ck = CheckpointDir(tmp_path / "run")
    marker = tmp_path / "pwned"

    def old_layout(d):  # what the previous version wrote, with the attacker's extra_state.pt
        eng.export_hf(d / "actor")
        torch.save(eng.optimizer.state_dict(), d / "actor" / "optim.pt")
        (d / "actor" / "extra_state.pt").write_bytes(pickle.dumps(_RunsCode(str(marker))))

    ck.save(1, old_layout)
    path = ck.load(1)  # the manifest matches: verification alone cannot catch it
    with pytest.raises(StateFileError) as ei:
        eng.load(path / "actor")
    msg = str(ei.value)
    assert "older layout" in msg and "extra_state.pt" in msg and "Fix:" in msg and "model.path" in msg
    assert isinstance(ei.value, DapoUserError) and not marker.exists()


# ----------------------------------------------------------------------------- verification on every path
def test_verify_folder_and_enclosing_checkpoint(tmp_path):
    ck = CheckpointDir(tmp_path)
    path = ck.save(2, _writer({"actor/model.safetensors": b"w" * 10, "actor/config.json": b"{}"}))
    assert enclosing_checkpoint(path / "actor") == path and enclosing_checkpoint(path) == path
    assert verify_folder(path)["step"] == 2
    assert enclosing_checkpoint(tmp_path / "elsewhere") is None
    (path / "actor" / "model.safetensors").write_bytes(b"x" * 10)  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupted"):
        verify_folder(enclosing_checkpoint(path / "actor"))
    (path / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no MANIFEST\.json"):
        enclosing_checkpoint(path / "actor")


# ----------------------------------------------------------------------------- latest pointer recovery
@pytest.mark.parametrize("damage", ["deleted", "garbage", "names_missing_step"])
def test_lost_latest_pointer_recovers_newest_valid_checkpoint(tmp_path, damage):
    ck = CheckpointDir(tmp_path)
    for s in (1, 2, 3):
        ck.save(s, _writer({"w.bin": bytes([s]) * 8}))
    (ck.path(3) / "w.bin").write_bytes(b"\0" * 8)  # step 3 damaged: the recovery must skip it
    latest = ck.dir / "latest"
    if damage == "deleted":
        latest.unlink()
    elif damage == "garbage":
        latest.write_bytes(b"\xff\xfe not a number")
    else:
        latest.write_text("7\n")
    warnings: list[str] = []
    before = latest.read_bytes() if latest.exists() else None
    assert ck.resume_step(warn=warnings.append, repair=False) == 2  # read-only callers (eval, preflight)
    assert (latest.read_bytes() if latest.exists() else None) == before
    warnings.clear()
    assert ck.resume_step(warn=warnings.append) == 2
    assert len(warnings) == 1 and "step_2" in warnings[0] and "step 3" in warnings[0]
    assert ck.latest_step() == 2  # pointer rewritten
    assert CheckpointDir(tmp_path).resume_step(warn=warnings.append) == 2 and len(warnings) == 1


def test_no_valid_checkpoint_is_an_error_not_a_restart(tmp_path):
    ck = CheckpointDir(tmp_path)
    assert ck.resume_step() is None  # a new run: nothing to recover
    ck.save(1, _writer({"w.bin": b"a"}))
    (ck.path(1) / "w.bin").write_bytes(b"b")
    (ck.dir / "latest").unlink()
    with pytest.raises(CheckpointError, match="none of the checkpoints") as ei:
        ck.resume_step()
    assert "Fix:" in str(ei.value)


# ----------------------------------------------------------------------------- ledger
def test_missing_ledger_of_a_run_with_steps_is_refused(tmp_path):
    root = tmp_path / "run"
    with RunStore(root) as store:
        store.write_stage(1, "batch", pa.table({"x": [1]}))
    (root / "ledger.sqlite").unlink()
    for side in root.glob("ledger.sqlite-*"):
        side.unlink()
    with pytest.raises(StoreError, match=r"ledger.*missing.*1 step folders") as ei:
        RunStore(root)
    assert "experiment_name" in str(ei.value) and not (root / "ledger.sqlite").exists()
    RunStore(tmp_path / "fresh").close()  # a new run still gets a new ledger


# ----------------------------------------------------------------------------- full disk
def _full_on(needle: str):
    def hook(path):
        if needle in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    return hook


def test_full_disk_during_stage_commit_keeps_store_consistent(tmp_path, monkeypatch):
    store = RunStore(tmp_path / "run")
    store.write_stage(1, "generate_g0", pa.table({"x": [1, 2]}))
    monkeypatch.setattr(store_files, "write_hook", _full_on("reward_g0.arrow"))
    with pytest.raises(DiskFull) as ei:
        store.write_stage(1, "reward_g0", pa.table({"x": [3]}))
    msg = str(ei.value)
    assert "reward_g0.arrow" in msg and "free" in msg and "Fix:" in msg and "resume" in msg
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOSPC
    assert store.committed_stages(1) == ["generate_g0"]
    assert not [p for p in store.step_dir(1).iterdir() if ".tmp-" in p.name]
    # the manifest write failing (after the data) leaves the stage uncommitted too
    monkeypatch.setattr(store_files, "write_hook", _full_on("reward_g0.manifest"))
    with pytest.raises(DiskFull, match=r"reward_g0\.manifest\.json"):
        store.write_stage(1, "reward_g0", pa.table({"x": [3]}))
    assert store.committed_stages(1) == ["generate_g0"]
    monkeypatch.setattr(store_files, "write_hook", None)  # space freed: the same commit now works
    store.write_stage(1, "reward_g0", pa.table({"x": [3]}))
    assert store.read_stage(1, "reward_g0").column("x").to_pylist() == [3]
    monkeypatch.setenv(store_files.FAULT_ENV, "state.json")  # the cross-process switch
    with pytest.raises(DiskFull, match=r"state\.json"):
        store.write_json("state.json", {"a": 1})
    store.close()


def test_full_ledger_is_rolled_back_and_named(tmp_path):
    store = RunStore(tmp_path / "run")
    store.register_prompts(["a1"], 1)
    pages = store._conn().execute("PRAGMA page_count").fetchone()[0]
    store._conn().execute(f"PRAGMA max_page_count={pages}")  # SQLite's own "database or disk is full"
    with pytest.raises(DiskFull, match=r"ledger.*ledger\.sqlite") as ei:
        store.register_prompts([f"b{i}" for i in range(2000)], 2, payloads=[b"x" * 512] * 2000)
    assert "Fix:" in str(ei.value) and store.count("train") == 1
    store._conn().execute("PRAGMA max_page_count=1073741823")
    assert store.register_prompts(["c1"], 2) == 1 and store.count("train") == 2
    store.close()


def test_full_disk_during_checkpoint_save_keeps_previous_checkpoint(tmp_path):
    ck = CheckpointDir(tmp_path)
    ck.save(1, _writer({"w.bin": b"one"}))

    def fills_up(d):
        (d / "w.bin").write_bytes(b"tw")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFull, match="step_2") as ei:
        ck.save(2, fills_up)
    assert "Fix:" in str(ei.value)
    assert ck.latest_step() == 1 and ck.steps() == [1] and not list(ck.dir.glob(".tmp-*"))
    assert verify_folder(ck.path(1))["step"] == 1


def test_critic_checkpoint_round_trips_without_pickle(tiny_dir, tmp_path):
    from dapo_core.compute.workers import CriticWorker

    def critic():
        return CriticWorker(str(tiny_dir), {"optim": {"lr": 3e-3}}, pad_token_id=0, rollout_n=2)

    a = critic()
    sum(p.float().pow(2).sum() for p in a.model.parameters()).backward()
    a.optimizer.step()
    a.save_checkpoint(str(tmp_path / "critic"))
    assert not list((tmp_path / "critic").glob("*.pt"))
    b = critic()
    b.load_checkpoint(str(tmp_path / "critic"))
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k]["exp_avg"], ob[k]["exp_avg"]) for k in oa)
    (tmp_path / "old").mkdir()
    torch.save({"model": {}}, tmp_path / "old" / "critic.pt")  # the older, pickled layout
    with pytest.raises(StateFileError, match="older layout"):
        b.load_checkpoint(str(tmp_path / "old"))


def test_preflight_and_dapo_eval_follow_a_lost_latest_pointer(tmp_path):
    # Before: both resolved a run folder through the pointer alone and reported "no checkpoint" here.
    from dapo_core.config import DapoConfig
    from dapo_core.preflight import model_folder_of
    from flows.run_guard import resolve_eval_checkpoint

    ck = CheckpointDir(tmp_path / "r1")
    for s in (1, 2):
        ck.save(s, _writer({"actor/model.safetensors": bytes([s]) * 8, "actor/config.json": b"{}"}))
    (ck.dir / "latest").unlink()
    assert model_folder_of(str(tmp_path / "r1")) == str(ck.path(2) / "actor")
    cfg = DapoConfig()
    cfg.trainer.runs_dir, cfg.trainer.experiment_name = str(tmp_path), "r1"
    assert resolve_eval_checkpoint(cfg) == str(tmp_path / "r1")
    cfg.trainer.experiment_name = ""  # the newest run with a checkpoint
    assert resolve_eval_checkpoint(cfg) == str(tmp_path / "r1")
    assert not (ck.dir / "latest").exists()  # read-only: the pointer is repaired only by a resume
