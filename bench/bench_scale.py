"""Run-store scale benchmark: bytes written per step, bytes through the driver, driver seconds per step and
disk after N steps with retention.

Two modes, each runnable against this checkout or another one (`--tree`, e.g. a `git worktree` of a commit
without the column-delta store), so the figures of both trees come from the same script:

    # bytes passing through the driver per step of the tiny default (`make train`'s config), real flow + Ray
    .venv/bin/python bench/bench_scale.py driver --steps 2
    .venv/bin/python bench/bench_scale.py driver --steps 2 --tree /work/tmp/wt_other

    # a synthetic step at the recipe's batch shape (8,192 trajectories), no model: store, validation,
    # transfer (the tables a stage hands on) and advantage, with the stage sequence of the sync order
    .venv/bin/python bench/bench_scale.py synthetic --rows 8192 --resp-len 512 --steps 4
    .venv/bin/python bench/bench_scale.py synthetic --rows 8192 --resp-len 512 --steps 4 \
        --tree /work/tmp/wt_other

    # the replay-buffer step order (trainer.step_order=replay_buffer, parameter_sync_step=2): driver bytes
    # per step as above, plus bytes written per step / unique bytes per step of the run folder's stage files
    .venv/bin/python bench/bench_scale.py driver --order replay_buffer --steps 3
    .venv/bin/python bench/bench_scale.py driver --order replay_buffer --steps 3 --tree /work/tmp/wt_other

`driver` counts, in the driver process, the Arrow bytes of every table the tasks read from or write to the run
store and of every table handed to or returned by a worker call (Ray serialises those through the driver).
`synthetic` prints JSON: bytes written per step, unique bytes per step (each value once), driver seconds per
step (store reads/writes and the batch transfer the driver does: without the column-delta store all of them,
with it the prompts it draws and the filter/assemble selections, the rest being the workers'), and the run
folder's size after N steps (with retention where the tree has it: a checkpoint every step).
`driver --order replay_buffer` keeps every step folder (`trainer.keep_rollouts_every=1`) and adds
`tests.helpers.store_accounting` of the run folder (always this checkout's, whatever `--tree`): the data
bytes of every stage file against the unique bytes, per step, and the number of token-level cells written
again with a value an earlier file already holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Imported before `--tree` goes ahead of this checkout on sys.path; imports nothing of dapo_core or flows.
from tests.helpers import store_accounting


def _tree(args) -> Path:
    tree = Path(args.tree or Path(__file__).resolve().parents[1]).resolve()
    sys.path.insert(0, str(tree))
    os.chdir(tree)
    return tree


def _nbytes(x) -> int:
    import pyarrow as pa

    if isinstance(x, pa.Table | pa.RecordBatch):
        return int(x.nbytes)
    if isinstance(x, tuple | list):
        return sum(_nbytes(v) for v in x)
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    return 0


def driver(args) -> dict:
    """Run the tiny default for `--steps` steps and count the table bytes through the driver (and, for the
    replay-buffer order, the run folder's bytes written / unique bytes)."""
    tree = _tree(args)
    import numpy as np

    from dapo_core.compute import rpc
    from dapo_core.config import load_config, to_yaml
    from dapo_core.store import RunStore

    counts = {"store_read": 0, "store_written": 0, "to_workers": 0, "from_workers": 0}

    def wrap(cls, name, kind, size):
        orig = getattr(cls, name, None)
        if orig is None:
            return

        def f(self, *a, **k):
            out = orig(self, *a, **k)
            counts[kind] += size(a, k, out)
            return out

        setattr(cls, name, f)

    wrap(RunStore, "read_uri", "store_read", lambda a, k, out: _nbytes(out))
    wrap(RunStore, "read_lengths", "store_read", lambda a, k, out: _nbytes(out))
    wrap(
        RunStore,
        "write_stage",
        "store_written",
        lambda a, k, out: _nbytes(a[2] if len(a) > 2 else k["table"]),
    )
    wrap(RunStore, "write_selection", "store_written", lambda a, k, out: 16 * len(np.asarray(a[2])))
    wrap(rpc.Handle, "submit", "to_workers", lambda a, k, out: _nbytes(a[1:]) + _nbytes(k))
    wrap(rpc.Handle, "wait", "from_workers", lambda a, k, out: _nbytes(out))
    runs = Path(tempfile.mkdtemp(prefix="bench_scale_runs_"))
    main = Path(__file__).resolve().parents[1]
    cfg = load_config(
        tree / "configs" / "tiny_cpu.yaml",
        [
            f"trainer.runs_dir={runs}",
            f"trainer.models_dir={main / 'models'}",
            f"data.train_files=[{main / 'data' / 'train.parquet'}]",
            f"data.val_files=[{main / 'data' / 'val.parquet'}]",
            f"trainer.total_training_steps={args.steps}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            "trainer.experiment_name=bench-driver",
            *(
                [
                    "trainer.step_order=replay_buffer",
                    "trainer.parameter_sync_step=2",
                    "trainer.keep_rollouts_every=1",
                ]
                if args.order == "replay_buffer"
                else []
            ),
        ],
    )
    from flows.dapo_train import dapo_train

    t0 = time.perf_counter()
    dapo_train(to_yaml(cfg), "bench-driver")
    wall = time.perf_counter() - t0
    total = sum(counts.values())
    out = {
        "tree": str(tree),
        "steps": args.steps,
        "driver_bytes_per_step": round(total / args.steps),
        **{f"{k}_per_step": round(v / args.steps) for k, v in counts.items()},
        "wall_s": round(wall, 1),
    }
    if args.order == "replay_buffer":
        acct = store_accounting(runs / "bench-driver")
        steps = max(len(acct["per_step"]), 1)
        out = {
            "order": args.order,
            **out,
            "written_bytes_per_step": round(acct["written"] / steps),
            "unique_bytes_per_step": round(acct["unique"] / steps),
            "written_over_unique": acct["written_over_unique"],
            "token_cells_written_again": acct["token_cells_again"],
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        }
    shutil.rmtree(runs, ignore_errors=True)
    return out


def _synthetic_tables(rows: int, resp_len: int, prompt_len: int, n: int, seed: int):
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    groups = rows // n
    uids = [f"{seed:08x}{g:024x}" for g in range(groups) for _ in range(n)]
    lens = np.clip(rng.exponential(resp_len / 2, rows).astype(np.int64), 1, resp_len)

    def lists(lengths, dtype, fill):
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = fill(int(offsets[-1])).astype(dtype)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    prompts = pa.table(
        {
            "uid": pa.array(uids),
            "prompt_id": pa.array(np.repeat(np.arange(groups), n), pa.int64()),
            "sample_idx": pa.array(np.tile(np.arange(n), groups), pa.int32()),
            "data_source": pa.array(["synthetic_arith"] * rows),
            "ground_truth": pa.array(["42"] * rows),
            "prompt_ids": lists(np.full(rows, prompt_len), np.int32, lambda m: rng.integers(3, 1000, m)),
        }
    )
    gen = {
        "response_ids": lists(lens, np.int32, lambda m: rng.integers(3, 1000, m)),
        "rollout_log_probs": lists(lens, np.float32, lambda m: -rng.random(m)),
        "weight_version": pa.array(np.zeros(rows, np.int64)),
        "gen_step": pa.array(np.ones(rows, np.int64)),
        "finish_reason": pa.array(["stop"] * rows),
    }
    acc = rng.random(rows) < 0.5
    reward = {
        "score": pa.array(np.where(acc, 1.0, -1.0).astype(np.float32)),
        "acc": pa.array(acc),
        "pred": pa.array(["42"] * rows),
        "overlong_reward": pa.array(np.zeros(rows, np.float32)),
        "reward": pa.array(np.where(acc, 1.0, -1.0).astype(np.float32)),
    }
    return prompts, gen, reward


def synthetic(args) -> dict:
    """Synthetic steps through the store at `--rows` trajectories (module docstring)."""
    tree = _tree(args)
    import inspect

    import numpy as np
    import pyarrow as pa

    from dapo_core.data.schemas import validate_stage
    from dapo_core.stages import apply_group_filter, compute_advantage_table
    from dapo_core.store import RunStore

    delta = "base" in inspect.signature(RunStore.write_stage).parameters
    retention = None
    if (tree / "dapo_core" / "store" / "retention.py").exists():
        from dapo_core.store.retention import apply_retention as retention
    root = Path(tempfile.mkdtemp(prefix="bench_scale_store_", dir=args.dir)) / "run"
    store = RunStore(root)
    n, limits = (
        args.n,
        {"vocab_size": 1000, "max_prompt_length": args.prompt_len, "max_response_length": args.resp_len},
    )
    per_step = []
    for step in range(1, args.steps + 1):
        prompts, gen, reward = _synthetic_tables(args.rows, args.resp_len, args.prompt_len, n, step)
        g = prompts
        for k, v in gen.items():
            g = g.append_column(k, v)
        r = g
        for k, v in reward.items():
            r = r.append_column(k, v)
        unique = prompts.nbytes + sum(v.nbytes for v in gen.values()) + sum(v.nbytes for v in reward.values())
        t_drv = t_wrk = 0.0

        def w(stage, table, base=None, step=step, on_worker=True):
            """Write a stage; its time is the worker's with the column-delta store, except for the stages
            the driver itself computes (`on_worker=False`), and the driver's without it (every table passes
            through the driver)."""
            nonlocal t_drv, t_wrk
            t0 = time.perf_counter()
            uri = (
                store.write_stage(step, stage, table, base=base)
                if delta
                else store.write_stage(step, stage, table)
            )
            if delta and on_worker:
                t_wrk += time.perf_counter() - t0
            else:
                t_drv += time.perf_counter() - t0
            return uri

        def rd(uri, **kw):
            nonlocal t_drv
            t0 = time.perf_counter()
            t = store.read_uri(uri, **kw)
            t_drv += time.perf_counter() - t0
            return t

        t0 = time.perf_counter()
        validate_stage("generate", g, n=n, **limits)
        validate_stage("reward", r, n=n, **limits)
        t_validate = time.perf_counter() - t0
        u_p = w("prompts_g0", prompts, on_worker=False)
        u_g = w("generate_g0", g, u_p)
        u_r = w("reward_g0", r, u_g)
        # filter (by the acc column) and assemble the batch
        t0 = time.perf_counter()
        if delta:
            proj = store.read_uri(u_r, verify=False, columns=["uid", "acc"])
            proj = proj.append_column("_row", pa.array(np.arange(proj.num_rows)))
            kept_rows = apply_group_filter(proj, "acc").kept.column("_row").to_numpy()
            u_k = store.write_selection(step, "kept_g0", kept_rows, base=u_r)
            lengths = store.read_lengths(u_k, ["prompt_ids", "response_ids"])
            u_b = store.write_selection(step, "batch", np.arange(lengths.num_rows), base=[u_k])
            t_drv += time.perf_counter() - t0
        else:
            t_drv += time.perf_counter() - t0
            kept = apply_group_filter(rd(u_r), "acc").kept
            u_k = w("kept_g0", kept)
            u_b = w("batch", rd(u_k))
        t0 = time.perf_counter()
        batch = store.read_uri(u_b)  # on a worker (column-delta store) or in the driver
        t_transfer = time.perf_counter() - t0
        if delta:
            t_wrk += t_transfer
        else:
            t_drv += t_transfer
        olp = batch.append_column("old_log_probs", batch.column("rollout_log_probs"))
        unique += olp.column("old_log_probs").nbytes
        u_o = w("old_log_prob", olp, u_b)
        t0 = time.perf_counter()
        adv, _ = compute_advantage_table(olp, pad_token_id=0, adv_estimator="grpo")
        t_adv = time.perf_counter() - t0
        unique += sum(adv.column(c).nbytes for c in adv.column_names if c not in olp.column_names)
        w("advantage", adv, u_o)
        written = sum(p.stat().st_size for p in store.step_dir(step).iterdir())
        per_step.append(
            {
                "written_bytes": written,
                "unique_bytes": unique,
                "driver_store_s": round(t_drv, 3),
                "worker_store_s": round(t_wrk, 3),
                "validate_s": round(t_validate, 3),
                "transfer_read_s": round(t_transfer, 3),
                "advantage_s": round(t_adv, 3),
            }
        )
        if retention is not None:
            retention(store, step, args.keep_every)  # a checkpoint every step
    disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    store.close()
    shutil.rmtree(root.parent, ignore_errors=True)
    mean = {k: sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}
    return {
        "tree": str(tree),
        "rows": args.rows,
        "resp_len_max": args.resp_len,
        "steps": args.steps,
        "column_delta": delta,
        "retention": retention is not None,
        "mean_per_step": {k: round(v, 3) for k, v in mean.items()},
        "written_over_unique": round(mean["written_bytes"] / mean["unique_bytes"], 3),
        "disk_after_steps_bytes": disk,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("driver")
    d.add_argument("--steps", type=int, default=2)
    d.add_argument("--tree", default=None)
    d.add_argument("--order", choices=["sync", "async", "replay_buffer"], default="sync")
    s = sub.add_parser("synthetic")
    s.add_argument("--rows", type=int, default=8192)
    s.add_argument("--n", type=int, default=16)
    s.add_argument("--resp-len", type=int, default=512)
    s.add_argument("--prompt-len", type=int, default=256)
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("--keep-every", type=int, default=0)
    s.add_argument("--dir", default=None)
    s.add_argument("--tree", default=None)
    args = p.parse_args()
    out = driver(args) if args.mode == "driver" else synthetic(args)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
