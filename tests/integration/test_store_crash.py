"""Crash test of the run store: a child process writes stages, ledger updates and checkpoints in a loop;
the parent SIGKILLs it at random instants (>= 30 times), reopens the store and checks the invariants:

- every stage the child reported committed (it reports only after ``write_stage`` returned) is committed
  and verifies; every manifest on disk verifies (no torn stage: committed with a valid checksum, or absent);
- the ledger is consistent (no reported prompt lost, trajectories only under known prompts, a finished
  prompt has all its trajectories) and ``reissue_inflight`` re-issues exactly the in-flight prompts, keeping
  the set of prompts unchanged;
- ``latest`` always points to a complete, verifying checkpoint at least as new as the last reported save.

Children are forked from a forkserver that pre-imported pyarrow (each start takes milliseconds).
``DAPO_CRASH_KILLS`` overrides the number of kills (default 40).
"""

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

from dapo_core.store import RunStore
from dapo_core.store.checkpoint import CheckpointDir
from tests.helpers import wait_for

N = 4
KEEP = 2

CHILD = r"""
import os, random, uuid
import pyarrow as pa
from dapo_core.store import RunStore

root, report, seed = ARGS[0], ARGS[1], int(ARGS[2])
N, KEEP = 4, 2
store = RunStore(root)
ck = store.checkpoints
rep = open(report, "a")
def log(line):
    rep.write(line + "\n"); rep.flush(); os.fsync(rep.fileno())
rng = random.Random(seed)
pa.table({"w": pa.array([[1]], pa.list_(pa.int32()))})  # warm-up: pyarrow imports pandas lazily (~1 s)
step = (store.steps() or [0])[-1]
# re-run (overwrite) a stage of the previous step: must end committed-and-valid or absent
if step:
    store.write_stage(step, "rerun", pa.table({"x": pa.array(range(rng.randint(1, 3000)))}))
log("ready")
while True:
    step += 1
    uids = [uuid.uuid4().hex for _ in range(3)]
    store.put_many([(u, {"is_prompt": True, "status": "pending", "global_steps": step}, b"row-" + u.encode())
                    for u in uids])
    log("prompts " + " ".join(uids))
    store.update_tags(uids, status="running")
    for u in uids:
        store.put_many([(f"{u}_{i}", {"status": "success", "global_steps": step}) for i in range(N)])
        if rng.random() < 0.8:
            store.update_tags(u, status="finished")
    for stage in ("generate_g0", "batch"):
        rows = rng.randint(1, 400)
        t = pa.table({"uid": pa.array([uids[i % 3] for i in range(rows)]),
                      "response_ids": pa.array([[step] * rng.randint(1, 64) for _ in range(rows)],
                                               pa.list_(pa.int32()))})
        store.write_stage(step, stage, t, meta={"step": step})
        log(f"stage {step} {stage} {rows}")
    if step % 3 == 0:
        blob = rng.randbytes(rng.randint(10_000, 300_000))
        def write(d, blob=blob):
            (d / "model.bin").write_bytes(blob)
            (d / "rng").mkdir()
            (d / "rng" / "state.bin").write_bytes(blob[:100])
        ck.save(step, write, meta={"train_step": step})
        log(f"ckpt {step}")
        ck.keep_last(KEEP)
"""


def _reported(report: Path):
    text = report.read_text() if report.exists() else ""
    lines = text.split("\n")[:-1]  # the last piece has no newline: possibly torn, ignore it
    prompts, stages, ckpts = set(), {}, []
    for line in lines:
        kind, *rest = line.split()
        if kind == "prompts":
            prompts.update(rest)
        elif kind == "stage":
            stages[(int(rest[0]), rest[1])] = int(rest[2])
        elif kind == "ckpt":
            ckpts.append(int(rest[0]))
    return prompts, stages, ckpts, lines.count("ready")


def _check(root: Path, report: Path, next_step: int) -> dict:
    prompts_reported, stages, ckpts, _ = _reported(report)
    store = RunStore(root)
    try:
        # stages reported committed are committed and verify, with the reported row count
        for (step, stage), rows in stages.items():
            assert store.is_committed(step, stage), f"reported stage {stage}@{step} lost"
            assert store.read_stage(step, stage).num_rows == rows
        # no torn stage anywhere: a manifest on disk always verifies
        for step in store.steps():
            for man in store.step_dir(step).glob("*.manifest.json"):
                stage = man.name[: -len(".manifest.json")]
                store.verify_stage(step, stage)
        # ledger consistency
        prompts = dict(store.items("train", is_prompt=True))
        trajs = store.items("train", is_prompt=False)
        assert prompts_reported <= set(prompts), "a reported prompt is missing from the ledger"
        per_uid = {}
        for key, _ in trajs:
            uid = key.split("_")[0]
            assert uid in prompts, f"trajectory {key} has no prompt"
            per_uid[uid] = per_uid.get(uid, 0) + 1
        for uid, tags in prompts.items():
            if tags["status"] == "finished":
                assert per_uid.get(uid, 0) == N, (
                    f"finished prompt {uid} has {per_uid.get(uid, 0)} trajectories"
                )
            assert store.get(uid)[1] == b"row-" + uid.encode()
        inflight = {u for u, t in prompts.items() if t["status"] in ("pending", "running")}
        assert store.reissue_inflight("train", next_step) == len(inflight)
        after = dict(store.items("train", is_prompt=True))
        assert set(after) == set(prompts), "re-issue lost or added prompts"
        for uid in inflight:
            assert after[uid]["status"] == "pending" and after[uid]["global_steps"] == next_step
            assert store.count(uid=uid) == 1, f"re-issued prompt {uid} kept trajectories"
        for uid in set(prompts) - inflight:
            assert after[uid] == prompts[uid]
        assert store.count("train", is_prompt=True, status="running") == 0
        # checkpoints: latest is complete and verifies, and not older than the last reported save
        ck = CheckpointDir(root)
        assert not [p for p in ck.dir.iterdir() if p.name.startswith(".tmp-")]
        latest = ck.latest_step()
        if ckpts:
            assert latest is not None and latest >= max(ckpts)
        if latest is not None:
            ck.load()
            assert ck.meta(latest)["train_step"] == latest
        for s in ckpts[-KEEP:]:
            if s in ck.steps():
                ck.verify(s)
        return {
            "stages": len(stages),
            "prompts": len(prompts),
            "inflight": len(inflight),
            "ckpts": len(ckpts),
        }
    finally:
        store.close()


def _start_child(ctx, root: Path, report: Path, k: int):
    """A child running CHILD; forked from a forkserver that pre-imported pyarrow/pandas (fast start)."""
    proc = ctx.Process(target=exec, args=(CHILD, {"ARGS": [str(root), str(report), str(k)]}), daemon=True)
    proc.start()
    return proc


def test_sigkill_many_times_keeps_store_consistent(tmp_path):
    kills = int(os.environ.get("DAPO_CRASH_KILLS", "40"))
    root, report = tmp_path / "run", tmp_path / "report.txt"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["pandas", "pyarrow", "dapo_core.store.run_store", "dapo_core.store.checkpoint"]
    )
    rng = random.Random(1234)
    t0 = time.monotonic()
    stats, reissued, landed = {}, 0, 0
    try:
        for k in range(kills):
            readies = _reported(report)[3]
            proc = _start_child(ctx, root, report, k)
            try:

                def ready(proc=proc, readies=readies) -> bool:
                    assert proc.is_alive(), f"child died early (exit code {proc.exitcode})"
                    return _reported(report)[3] != readies

                wait_for(ready, f"child {k} to report ready", 60, 0.005)
                time.sleep(rng.uniform(0.0, 0.4))  # the kill lands at a random instant of the child's work
                assert proc.is_alive(), f"child crashed on its own (exit code {proc.exitcode})"
            finally:
                if proc.pid is not None and proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join()
            assert proc.exitcode == -signal.SIGKILL
            probe = RunStore(root)
            next_step = (probe.steps() or [0])[-1] + 1
            inflight_now = probe.count("train", is_prompt=True, status="running")
            probe.close()
            landed += inflight_now > 0
            stats = _check(root, report, next_step)
            reissued += stats["inflight"]
    finally:
        _stop_forkserver()
    elapsed = time.monotonic() - t0
    assert stats["stages"] > kills and stats["ckpts"] >= 1
    assert landed > 0, "no kill ever landed with prompts running: the test did not exercise re-issue"
    print(
        f"{kills} kills in {elapsed:.1f}s: {stats}; {landed} kills left running prompts; "
        f"re-issued {reissued} prompts in total"
    )


def _stop_forkserver() -> None:
    """Stop the forkserver process this test started (it would otherwise live until pytest exits)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()
