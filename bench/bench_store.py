"""Run-store throughput: stage write/read (MB/s, rows/s) and ledger rates. Not a test.

Writes a DAPO-sized batch (default 512 prompts × 16 trajectories, 2k-token per-token list columns)
through ``RunStore.write_stage`` (temp file + fsync + rename + manifest, sha256 while writing) and reads it
back with ``read_stage`` (sha256 verified; MB/s of the file and of the table it gives back, which differ
where the store encodes columns: the batch's all-ones ``response_mask`` is stored as run-length ends), then
times the ledger: ``put_many`` of every prompt and
trajectory key, ``update_tags`` of all prompts, ``list_keys`` by status, ``reissue_inflight``.
Each number is the median of ``--repeats`` runs (default 5).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_store.py [--prompts 512 --n 16 --tokens 2048 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid

import numpy as np
import pyarrow as pa

from dapo_core.store import RunStore


def make_batch(prompts: int, n: int, tokens: int, prompt_tokens: int, seed: int = 0) -> pa.Table:
    """A batch-contract-shaped table with fixed-length per-token list columns."""
    rng = np.random.default_rng(seed)
    rows = prompts * n

    def lists(values: np.ndarray, length: int) -> pa.ListArray:
        offsets = np.arange(0, rows * length + 1, length, dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    uids = np.repeat(np.array([uuid.uuid4().hex for _ in range(prompts)]), n)
    return pa.table(
        {
            "uid": pa.array(uids),
            "prompt_id": pa.array(np.repeat(np.arange(prompts, dtype=np.int64), n)),
            "sample_idx": pa.array(np.tile(np.arange(n, dtype=np.int32), prompts)),
            "prompt_ids": lists(
                rng.integers(0, 150_000, rows * prompt_tokens, dtype=np.int32), prompt_tokens
            ),
            "response_ids": lists(rng.integers(0, 150_000, rows * tokens, dtype=np.int32), tokens),
            "rollout_log_probs": lists(-rng.random(rows * tokens, dtype=np.float32), tokens),
            "old_log_probs": lists(-rng.random(rows * tokens, dtype=np.float32), tokens),
            "advantages": lists(rng.standard_normal(rows * tokens, dtype=np.float32), tokens),
            "response_mask": lists(np.ones(rows * tokens, dtype=np.int8), tokens),
            "reward": pa.array(rng.standard_normal(rows).astype(np.float32)),
        }
    )


def _median_time(fn, repeats: int) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    """Run the benchmark and print one JSON object with the medians."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to create the run store (default: a temp dir)")
    args = ap.parse_args()

    table = make_batch(args.prompts, args.n, args.tokens, args.prompt_tokens)
    rows = table.num_rows
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = RunStore(tmp)
        t_write = _median_time(lambda i: store.write_stage(i, "batch", table), args.repeats)
        man = store.manifest(0, "batch")
        mb, view_mb = man["bytes"] / 1e6, table.nbytes / 1e6
        t_read = _median_time(lambda i: store.read_stage(i, "batch"), args.repeats)
        t_read_nv = _median_time(lambda i: store.read_stage(i, "batch", verify=False), args.repeats)
        assert store.read_stage(0, "batch").equals(table)

        uids_of = [[uuid.uuid4().hex for _ in range(args.prompts)] for _ in range(args.repeats)]

        def ledger_put(i: int) -> None:  # one partition per repeat, so every repeat starts equal
            part, uids = f"p{i}", uids_of[i]
            store.put_many(
                [(u, {"is_prompt": True, "status": "pending", "global_steps": i}) for u in uids],
                partition=part,
            )
            store.put_many(
                [
                    (
                        f"{u}_{j}",
                        {
                            "status": "success",
                            "global_steps": i,
                            "min_global_steps": i,
                            "max_global_steps": i,
                            "response_len": args.tokens,
                        },
                    )
                    for u in uids
                    for j in range(args.n)
                ],
                partition=part,
            )

        t_put = _median_time(ledger_put, args.repeats)
        keys_put = args.prompts * (args.n + 1)
        t_upd = _median_time(lambda i: store.update_tags(uids_of[i], status="running"), args.repeats)
        listed = []
        t_list = _median_time(
            lambda i: listed.append(store.list_keys(f"p{i}", is_prompt=True, status="running")), args.repeats
        )
        assert all(len(keys) == args.prompts for keys in listed)
        counts = []
        t_reissue = _median_time(
            lambda i: counts.append(store.reissue_inflight(f"p{i}", 100 + i)), args.repeats
        )
        assert counts == [args.prompts] * args.repeats and store.count("p0") == args.prompts
        store.close()

    out = {
        "batch": {
            "rows": rows,
            "tokens_per_row": args.tokens,
            "file_MB": round(mb, 1),
            "table_MB": round(view_mb, 1),
            "encoded": man.get("encoded", {}),
        },
        "write_stage": {
            "s": round(t_write, 3),
            "MB_per_s": round(mb / t_write, 1),
            "table_MB_per_s": round(view_mb / t_write, 1),
            "rows_per_s": round(rows / t_write),
        },
        "read_stage_verified": {
            "s": round(t_read, 3),
            "MB_per_s": round(mb / t_read, 1),
            "table_MB_per_s": round(view_mb / t_read, 1),
            "rows_per_s": round(rows / t_read),
        },
        "read_stage_unverified": {"s": round(t_read_nv, 3), "MB_per_s": round(mb / t_read_nv, 1)},
        "ledger_put_many": {"keys": keys_put, "s": round(t_put, 3), "keys_per_s": round(keys_put / t_put)},
        "ledger_update_tags": {
            "keys": args.prompts,
            "s": round(t_upd, 4),
            "keys_per_s": round(args.prompts / t_upd),
        },
        "ledger_list_keys": {"keys": args.prompts, "s": round(t_list, 4)},
        "reissue_inflight": {
            "prompts": args.prompts,
            "trajectories_deleted": args.prompts * args.n,
            "s": round(t_reissue, 4),
        },
        "repeats": args.repeats,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
