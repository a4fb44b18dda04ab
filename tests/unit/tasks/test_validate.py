"""Validation as a worker job (tasks/validate.py): the rollout and reward workers read the held-out prompts
from the run store, generate, score, validate and commit stage `val` themselves; the driver gets the metrics.

Compared with the path it replaced, on the same weights and seed: the driver built the repeated prompt table,
sent it to the rollout worker, got the generation back, scored it through the reward worker, computed
`validation_summary` itself and committed the scored table. Real run store, real workers (in-process), real
Prefect task function."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from dapo_core.compute import rpc
from dapo_core.config import load_config, typed
from dapo_core.data import batch as B
from dapo_core.metrics.validation import validation_summary
from dapo_core.seeding import uid_factory
from dapo_core.store import RunStore
from tests.helpers import in_process_run_overrides

CONFIG = "configs/tiny_cpu.yaml"


def _nbytes(x) -> int:
    if isinstance(x, pa.Table):
        return int(x.nbytes)
    if isinstance(x, tuple | list):
        return sum(_nbytes(v) for v in x)
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    return 0


@pytest.fixture
def driver_bytes(monkeypatch):
    """Arrow bytes of the tables the driver reads from / writes to the store and hands to / gets back from
    workers (the way bench/bench_scale.py's `driver` mode counts them)."""
    counts = {"bytes": 0}

    def count(cls, name, size):
        orig = getattr(cls, name)

        def f(self, *a, **k):
            out = orig(self, *a, **k)
            counts["bytes"] += size(a, k, out)
            return out

        monkeypatch.setattr(cls, name, f)

    count(RunStore, "read_uri", lambda a, k, out: _nbytes(out))
    count(RunStore, "read_lengths", lambda a, k, out: _nbytes(out))
    count(RunStore, "write_stage", lambda a, k, out: _nbytes(a[2] if len(a) > 2 else k["table"]))
    count(rpc.Handle, "submit", lambda a, k, out: _nbytes(a[1:]) + _nbytes(k))
    count(rpc.Handle, "wait", lambda a, k, out: _nbytes(out))
    return counts


@pytest.fixture
def run(tmp_path):
    """An opened run (in-process workers) on a random tiny model and 12 synthetic held-out prompts."""
    from flows.run_setup import close_run, open_run

    torch.set_num_threads(1)
    overrides = [
        *in_process_run_overrides(tmp_path, num_train=64, num_val=12),
        f"trainer.runs_dir={tmp_path / 'runs'}",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
    ]
    cfg = typed(load_config(CONFIG, overrides))
    rt = open_run(cfg, "valjob")
    yield rt
    close_run(rt)


def test_validation_metrics_equal_the_driver_path_and_no_table_passes_through_the_driver(run, driver_bytes):
    from tasks.validate import validate

    rt = run
    n = rt.cfg.actor_rollout_ref.rollout.val_kwargs.n
    step, gen_step = 3, 2

    # the path validation replaced, on the same weights: the tables go through the driver
    driver_bytes["bytes"] = 0
    table = B.repeat_interleave_prompts(
        rt.val_prompts, n, uid_fn=uid_factory(rt.cfg.trainer.seed, "val", step)
    )
    out = rt.rollout.generate(table, gen_step, True)
    out, _ = rt.reward.score(out)
    want = validation_summary(out)
    rt.store.write_stage(step + 100, "val", out)  # what its run_stage committed
    before = driver_bytes["bytes"]

    driver_bytes["bytes"] = 0
    uri, metrics = validate.fn(rt, step, gen_step)
    after = driver_bytes["bytes"]
    print(f"\ndriver bytes per validation: before {before:,}  after {after:,}")

    assert {k: v for k, v in metrics.items() if not k.startswith("timing_s/")} == want  # exactly
    assert metrics["timing_s/val"] > 0
    assert any(k.startswith("val-core/synthetic_arith/acc/mean@4") for k in metrics)
    got = rt.store.read_uri(uri)
    for col in ("uid", "sample_idx", "response_ids", "score", "acc", "pred", "reward"):
        assert got.column(col).equals(out.column(col)), col
    assert rt.store.committed_stages(step) == ["val", "val_generate", "val_prompts"]
    # the driver wrote the distinct prompts once; nothing generated or scored came through it
    assert after <= rt.val_prompts.nbytes < before / n

    # committed: a second call returns the committed metrics and recomputes nothing
    driver_bytes["bytes"] = 0
    again_uri, again = validate.fn(rt, step, gen_step)
    assert again_uri == uri and driver_bytes["bytes"] == 0
    assert {k: v for k, v in again.items() if not k.startswith("timing_s/")} == want
