"""Benchmark: pandera stage validation of a full-size DAPO batch vs an honest CPU reference op.

Batch: 512 prompts × n=16 = 8192 trajectories, responses of 2048 tokens (random ids / log-probs),
prompts of 256 tokens. For every stage we time ``validate_stage`` (median of 5, one thread) and compare
with the cost of the data movement the stage's worker must do anyway on the same rows: turning the
Arrow rows into padded tensors with ``dapo_core.data.batch.to_padded`` (prompts, responses, masks,
positions + the stage's per-token columns). A log-softmax over a (8192, 2048, vocab) slab is far too
big for this machine, so it is not the yardstick.

Also measured once: the same ``generate`` checks via the polars backend (``pl.from_arrow`` +
``pandera.polars``), to justify the pyarrow choice.

Run:  OMP_NUM_THREADS=1 .venv/bin/python bench/bench_schemas.py [--prompts 512] [--n 16] [--resp 2048]
Polars is pinned to one thread (POLARS_MAX_THREADS=1, set before import) like torch, so the
backend comparison is per core.
"""

from __future__ import annotations

import os

os.environ.setdefault("POLARS_MAX_THREADS", "1")

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa
import torch

from dapo_core.data import batch as B
from dapo_core.data import schemas as S

VOCAB = 151_936


def make_batch(prompts: int, n: int, resp: int, prompt_len: int, seed: int = 0) -> pa.Table:
    """A valid advantage-stage table (all columns) with fixed-length random rows."""
    rng = np.random.default_rng(seed)
    rows = prompts * n
    li32, lf32 = pa.list_(pa.int32()), pa.list_(pa.float32())

    def lst(values: np.ndarray, width: int, typ: pa.DataType) -> pa.Array:
        offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * width, pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1))).cast(typ)

    ntok = rows * resp
    lp = -rng.exponential(1.0, ntok).astype(np.float32)
    uids = np.repeat(np.array([f"{i:032x}" for i in range(prompts)], dtype=object), n)
    cols = {
        "uid": pa.array(uids, pa.string()),
        "prompt_id": pa.array(np.repeat(np.arange(prompts), n), pa.int64()),
        "sample_idx": pa.array(np.tile(np.arange(n), prompts).astype(np.int32)),
        "data_source": pa.array(["math_dapo"] * rows),
        "ground_truth": pa.array(["34"] * rows),
        "prompt_ids": lst(rng.integers(0, VOCAB, rows * prompt_len, dtype=np.int32), prompt_len, li32),
        "response_ids": lst(rng.integers(0, VOCAB, ntok, dtype=np.int32), resp, li32),
        "rollout_log_probs": lst(lp, resp, lf32),
        "weight_version": pa.array(np.zeros(rows, np.int64)),
        "gen_step": pa.array(np.zeros(rows, np.int64)),
        "finish_reason": pa.array(["stop"] * rows),
        "score": pa.array(rng.choice([-1.0, 1.0], rows).astype(np.float32)),
        "acc": pa.array(rng.random(rows) > 0.5),
        "pred": pa.array(["34"] * rows),
        "overlong_reward": pa.array(np.zeros(rows, np.float32)),
        "reward": pa.array(rng.choice([-1.0, 1.0], rows).astype(np.float32)),
        "old_log_probs": lst(lp, resp, lf32),
        "entropy": lst(rng.random(ntok, dtype=np.float32), resp, lf32),
        "ref_log_probs": lst(lp, resp, lf32),
        "values": lst(rng.standard_normal(ntok, dtype=np.float32), resp, lf32),
        "token_level_rewards": lst(np.zeros(ntok, np.float32), resp, lf32),
        "advantages": lst(rng.standard_normal(ntok, dtype=np.float32), resp, lf32),
        "returns": lst(rng.standard_normal(ntok, dtype=np.float32), resp, lf32),
        "response_mask": lst(np.ones(ntok, np.int8), resp, pa.list_(pa.int8())),
    }
    return pa.table(cols)


def median_time(fn, repeats: int = 5) -> float:
    """Median wall time (s) of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


STAGE_TENSOR_COLUMNS = {
    "generate": ["rollout_log_probs"],
    "reward": ["rollout_log_probs"],
    "old_log_prob": ["old_log_probs", "entropy"],
    "ref": ["ref_log_probs"],
    "values": ["values"],
    "advantage": ["token_level_rewards", "advantages", "returns"],
}


def polars_generate(table: pa.Table, n: int, max_r: int) -> float:
    """Time the core generate checks through pandera.polars (conversion included)."""
    import pandera.polars as ppl
    import polars as pl

    def len_ok(data):
        return data.lazyframe.select(
            pl.col("rollout_log_probs").list.len() == pl.col("response_ids").list.len()
        )

    def lp_ok(data):
        return data.lazyframe.select(
            pl.col("rollout_log_probs")
            .list.eval(pl.element().is_finite() & (pl.element() <= S.LOGPROB_TOL))
            .list.all()
        )

    def ids_ok(data):
        return data.lazyframe.select(
            pl.col("response_ids").list.eval((pl.element() >= 0) & (pl.element() < VOCAB)).list.all()
            & (pl.col("response_ids").list.len() <= max_r)
        )

    def group_ok(data):
        return data.lazyframe.select(pl.len().over("uid") == n)

    schema = ppl.DataFrameSchema(
        {
            "uid": ppl.Column(pl.String),
            "response_ids": ppl.Column(pl.List(pl.Int32)),
            "rollout_log_probs": ppl.Column(pl.List(pl.Float32)),
        },
        checks=[ppl.Check(f) for f in (len_ok, lp_ok, ids_ok, group_ok)],
    )
    sub = table.select(["uid", "response_ids", "rollout_log_probs"])
    return median_time(lambda: schema.validate(pl.from_arrow(sub), lazy=True))


def pyarrow_generate(table: pa.Table, n: int, max_r: int) -> float:
    """The same 4 checks as :func:`polars_generate`, through pandera.pyarrow (our backend)."""
    import pandera.pyarrow as ppa

    fns = [
        S._len_matches("rollout_log_probs"),
        S._finite("rollout_log_probs", hi=S.LOGPROB_TOL),
        lambda t: S._ids_in_vocab("response_ids", VOCAB)(t) & S._len_at_most("response_ids", max_r)(t),
        S._group_size(n),
    ]
    schema = ppa.DataFrameSchema(
        {
            "uid": ppa.Column(pa.string()),
            "response_ids": ppa.Column(pa.list_(pa.int32())),
            "rollout_log_probs": ppa.Column(pa.list_(pa.float32())),
        },
        checks=[ppa.Check(lambda d, f=f: pa.array(f(d.table))) for f in fns],
    )
    sub = table.select(["uid", "response_ids", "rollout_log_probs"])
    return median_time(lambda: schema.validate(sub, lazy=True))


def main() -> None:
    """Run the benchmark and print one line per stage."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--resp", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    table = make_batch(args.prompts, args.n, args.resp, args.prompt_len)
    rows = table.num_rows
    print(
        f"batch: {rows} rows × {args.resp} response tokens (+{args.prompt_len} prompt), "
        f"{table.nbytes / 2**20:.0f} MiB, built in {time.perf_counter() - t0:.1f}s; median of {args.repeats}"
    )
    kw = {
        "n": args.n,
        "vocab_size": VOCAB,
        "max_prompt_length": args.prompt_len,
        "max_response_length": args.resp,
    }
    print(f"{'stage':<14}{'validate ms':>12}{'to_padded ms':>14}{'ratio':>8}")
    for stage in S.STAGES:
        cols = S.STAGE_COLUMNS[stage] + S.OPTIONAL_COLUMNS[stage]
        sub = table.select([c for c in cols if c in table.column_names])
        tv = median_time(lambda sub=sub, stage=stage: S.validate_stage(stage, sub, **kw), args.repeats)
        tp = median_time(
            lambda sub=sub, stage=stage: B.to_padded(sub, 0, columns=STAGE_TENSOR_COLUMNS[stage]),
            args.repeats,
        )
        print(f"{stage:<14}{tv * 1e3:>12.1f}{tp * 1e3:>14.1f}{tv / tp:>8.2f}")
    tpl = polars_generate(table, args.n, args.resp)
    tpa = pyarrow_generate(table, args.n, args.resp)
    print(
        f"same 4 generate checks: pandera.pyarrow {tpa * 1e3:.1f} ms, "
        f"pandera.polars (incl. pl.from_arrow) {tpl * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
