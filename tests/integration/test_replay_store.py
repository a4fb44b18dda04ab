"""The replay-buffer step order over the column-delta run store, end to end (real Prefect, in-process
workers):

- no token-level column is written twice: over a few real tiny steps every list cell of the run folder is
  written once, and the data bytes written are <= 1.3x the unique bytes (`tests.helpers.store_accounting`,
  which `bench/bench_scale.py driver --order replay_buffer` reports too); the `replay_add` files and the
  sampled `batch` are row selections;
- the driver process reads no token-level column (only uids, metrics, weight versions, list lengths);
- a run SIGKILLed in the middle of a step, with default retention, resumes to final weights bitwise equal to
  the uninterrupted run's, and keeps exactly the step folders the replay buffer still references.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dapo_core.store import RunStore
from dapo_core.store.replay import referenced_steps
from tests.helpers import store_accounting
from tests.integration.conftest import (
    CONFIG,
    SHORT_RUN,
    kill_and_resume,
    tiny_overrides,
    train_cmd,
    train_here,
)

STEPS = 3
COMMON = {
    **SHORT_RUN,
    "trainer.step_order": "replay_buffer",
    "trainer.parameter_sync_step": 2,
    "trainer.total_training_steps": STEPS,
}


@pytest.fixture(scope="module")
def reference(tiny_assets):
    """The uninterrupted run (every step folder kept), with the list columns of every stage view the driver
    process read recorded (in-process workers read through their own `StageFiles`, not the `RunStore`)."""
    import flows.dapo_train as dt
    from dapo_core.config import load_config, to_yaml

    reads: list[tuple[int, str, list[str]]] = []
    original = RunStore.read_stage

    def recording(self, step, stage, verify=True, columns=None):
        table = original(self, step, stage, verify, columns)
        lists = [f.name for f in table.schema if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)]
        reads.append((step, stage, lists))
        return table

    extra = {**COMMON, "trainer.experiment_name": "replay-ref", "trainer.keep_rollouts_every": 1}
    cfg = load_config(CONFIG, tiny_overrides(tiny_assets, **extra))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunStore, "read_stage", recording)
        out = dt.dapo_train(to_yaml(cfg), "replay-ref")
    assert out["train_step"] == STEPS
    return Path(out["run_dir"]), reads


def test_no_token_column_written_twice_nor_read_in_the_driver(reference):
    run, reads = reference
    acct = store_accounting(run)
    assert sorted(acct["per_step"]) == list(range(1, STEPS + 1))
    assert acct["token_cells_again"] == 0, acct["per_step"]
    assert acct["written_over_unique"] <= 1.3, acct
    with RunStore(run) as store:
        for step in range(1, STEPS + 1):
            stages = store.committed_stages(step)
            assert "batch" in stages
            for stage in stages:
                if stage == "batch" or stage.startswith("replay_add_"):
                    man = store.manifest(step, stage)
                    assert man["selection"] and man["file_columns"] == [], (step, stage)
    assert reads, "the recording saw no driver read at all"
    token_reads = [(step, stage, lists) for step, stage, lists in reads if lists]
    assert token_reads == []


@pytest.mark.timeout(900)
def test_killed_mid_step_with_default_retention_resumes_bitwise(reference, tiny_assets):
    name = "replay-killed"
    extra = {**COMMON, "trainer.experiment_name": name, "trainer.keep_rollouts_every": 0}

    def killed_in_step_2(run: Path) -> None:
        with RunStore(run) as store:
            assert store.checkpoints.latest_step() == 1
            assert store.is_committed(2, "batch")

    run = tiny_assets / "runs" / name
    ov = tiny_overrides(tiny_assets, **extra)
    kill_and_resume(
        train_cmd(ov),
        run,
        "step_000002/update_actor_p0.manifest.json",  # between step 2's two local updates
        after_kill=killed_in_step_2,
        resume=lambda: train_here(ov),
        reference=reference[0],
        step=STEPS,
    )
    with RunStore(run) as store:
        pinned = referenced_steps(store)
        assert pinned and set(store.steps()) == pinned  # what the buffer still holds, nothing else
        for _, tags in store.items("train", is_prompt=False):
            store.read_uri(tags["uri"])
