"""Run-store throughput: stage write/read (MB/s, rows/s) and ledger rates. Not a test.

Writes a DAPO-sized batch (default 512 prompts × 16 trajectories, 2k-token per-token list columns)
through ``RunStore.write_stage`` (temp file + fsync + rename + manifest, sha256 while writing) and reads it
back with ``read_stage`` (sha256 verified; MB/s of the file and of the table it gives back, which differ
where the store encodes columns: the batch's all-ones ``response_mask`` is stored as run-length ends), then
times the ledger: ``put_many`` of every prompt and
trajectory key, ``update_tags`` of all prompts, ``list_keys`` by status, ``reissue_inflight``.
Each number is the median of ``--repeats`` runs (default 5). ``read_stage_verified`` reads each written
file as a fresh process would (the per-process trust cache cleared): it hashes the file, or takes it on trust
from its writer's trust record (``dapo_core/store/trust.py``) where the tree has them; ``files_hashed`` /
``files_trusted`` say which. ``model_32b`` applies the measured write and verified-read rates to the modelled
32B step (bench/README.md, "Extrapolation to DAPO-32B": 1.17 GB written and 2.35 GB read verified by the
workers per ~600 s step) and gives the storage share of the step. ``--tree`` runs an older checkout's store.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_store.py [--prompts 512 --n 16 --tokens 2048 --repeats 5]

``--step``: instead, one DAPO step's stage chain as the flow writes and reads it, per stage and per column —
``--gen-batches`` generation batches of prompts × n rows (prompts → generate → reward → kept: half the
groups), the batch (a selection of the kept rows), old_log_prob, and the advantage stage computed by the real
``compute_advantage_table`` (GRPO) — written with ``write_stage``/``write_selection`` as the workers do, then
read back verified in the pattern of the workers' processes after the files have settled (2 s): the reward
worker reads each generation view (score), the old_log_prob view (advantage) and the advantage view (step
metrics); the actor reads the batch view (old log-probs) and the advantage view (update). ``--tree`` runs an
older checkout's store (e.g. a ``git worktree`` of the commit before) with the same script:

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_store.py --step [--resp-len 512 --repeats 3 --tree DIR]

``--hashes``: whole-buffer checksum speeds on this CPU (sha256, blake2b, crc32; xxh3, crc32c if importable):

    OMP_NUM_THREADS=1 PYTHONPATH=<xxhash, google-crc32c> .venv/bin/python bench/bench_store.py --hashes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa

MODEL_32B = {"written_GB": 1.17, "verified_read_GB": 2.35, "step_s": 600.0}
"""Bytes a modelled DAPO-32B step writes and its workers read verified (store format 3), and its length in
seconds (bench/README.md, "Extrapolation to DAPO-32B")."""


def _use_tree(tree: str | None) -> None:
    """Import the store of the checkout ``tree`` (or of this one)."""
    if tree:
        path = Path(tree).resolve()
        sys.path.insert(0, str(path))
        os.chdir(path)


def _fresh_process() -> None:
    """Forget what this process verified, as a worker process that has not read the file yet (the cache is in
    `stage_io`; in older trees, in `stage_files`)."""
    for name in ("stage_io", "stage_files"):
        cache = getattr(sys.modules.get(f"dapo_core.store.{name}"), "_VERIFIED", None)
        if cache is not None:
            cache.clear()


def model_32b(write_mb_s: float, read_mb_s: float) -> dict:
    """The modelled 32B step's storage seconds and share at these rates (MB/s of file)."""
    w = MODEL_32B["written_GB"] * 1e3 / write_mb_s
    r = MODEL_32B["verified_read_GB"] * 1e3 / read_mb_s
    return {
        **MODEL_32B,
        "write_s": round(w, 2),
        "verified_read_s": round(r, 2),
        "storage_s": round(w + r, 2),
        "storage_share_pct": round(100 * (w + r) / MODEL_32B["step_s"], 2),
    }


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


def _step_tables(prompts: int, n: int, resp_len: int, prompt_len: int, seed: int):
    """prompts, generate and reward tables of one generation batch; response lengths exponential with mean
    resp_len / 2, clipped to [1, resp_len] (as bench_scale.py's synthetic step)."""
    rng = np.random.default_rng(seed)
    rows = prompts * n
    lens = np.clip(rng.exponential(resp_len / 2, rows).astype(np.int64), 1, resp_len)

    def lists(lengths, values: np.ndarray) -> pa.ListArray:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    tokens = int(lens.sum())
    p = pa.table(
        {
            "uid": pa.array([f"{seed:08x}{g:024x}" for g in range(prompts) for _ in range(n)]),
            "prompt_id": pa.array(np.repeat(np.arange(prompts), n), pa.int64()),
            "sample_idx": pa.array(np.tile(np.arange(n), prompts), pa.int32()),
            "data_source": pa.array(["synthetic_arith"] * rows),
            "ground_truth": pa.array(["42"] * rows),
            "prompt_ids": lists(
                np.full(rows, prompt_len), rng.integers(3, 150_000, rows * prompt_len).astype(np.int32)
            ),
        }
    )
    g = p
    for name, col in (
        ("response_ids", lists(lens, rng.integers(3, 150_000, tokens).astype(np.int32))),
        ("rollout_log_probs", lists(lens, -rng.exponential(0.3, tokens).astype(np.float32))),
        ("weight_version", pa.array(np.zeros(rows, np.int64))),
        ("gen_step", pa.array(np.ones(rows, np.int64))),
        ("finish_reason", pa.array(["stop"] * rows)),
    ):
        g = g.append_column(name, col)
    acc = np.repeat(rng.random(prompts) < 0.5, n) ^ (rng.random(rows) < 0.3)
    r = g
    for name, col in (
        ("score", pa.array(np.where(acc, 1.0, -1.0).astype(np.float32))),
        ("acc", pa.array(acc)),
        ("pred", pa.array(["42"] * rows)),
        ("overlong_reward", pa.array(np.zeros(rows, np.float32))),
        ("reward", pa.array(np.where(acc, 1.0, -1.0).astype(np.float32))),
    ):
        r = r.append_column(name, col)
    return p, g, r


def step(args) -> dict:
    """One DAPO step's stage chain through the store (module docstring)."""
    _use_tree(args.tree)
    from dapo_core.stages import compute_advantage_table
    from dapo_core.store import RunStore, stage_files

    rng = np.random.default_rng(0)
    batches = [
        _step_tables(args.prompts, args.n, args.resp_len, args.prompt_tokens, 10 + g)
        for g in range(args.gen_batches)
    ]
    keep = [np.sort(rng.permutation(args.prompts)[: args.prompts // 2]) for _ in batches]
    kept_rows = [(k[:, None] * args.n + np.arange(args.n)).ravel() for k in keep]
    olp = adv = None
    per: dict[str, list] = {}
    reads: dict[str, list] = {"reward_worker": [], "actor": []}
    hashed: list[int] = []
    trusted: list[int] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = RunStore(Path(tmp) / "run")
        for rep in range(args.repeats):
            s = rep + 1

            def w(method: str, stage: str, *a, s=s, **kw) -> str:
                t0 = time.perf_counter()
                uri = getattr(store, method)(s, stage, *a, **kw)
                per.setdefault(stage, []).append(
                    (time.perf_counter() - t0, store.manifest(s, stage)["bytes"])
                )
                return uri

            kept_uris, gen_uris = [], []
            for g, (p, gen, r) in enumerate(batches):
                u_p = w("write_stage", f"prompts_g{g}", p)
                gen_uris.append(w("write_stage", f"generate_g{g}", gen, base=u_p))
                u_r = w("write_stage", f"reward_g{g}", r, base=gen_uris[-1])
                kept_uris.append(w("write_selection", f"kept_g{g}", kept_rows[g], base=u_r))
            u_b = w("write_selection", "batch", np.arange(sum(len(k) for k in kept_rows)), base=kept_uris)
            if olp is None:
                b = store.read_uri(u_b)
                lp = b.column("rollout_log_probs").combine_chunks()
                noise = rng.normal(0, 0.01, len(lp.values)).astype(np.float32)
                olp = b.append_column(
                    "old_log_probs",
                    pa.ListArray.from_arrays(lp.offsets, pa.array(lp.values.to_numpy() + noise)),
                )
                adv, _ = compute_advantage_table(olp, pad_token_id=0, adv_estimator="grpo")
            u_o = w("write_stage", "old_log_prob", olp, base=u_b)
            u_a = w("write_stage", "advantage", adv, base=u_o)
            time.sleep(2.1)  # the files settle (at the recipe's shape a stage takes minutes)
            for proc, uris in (("reward_worker", [*gen_uris, u_o, u_a]), ("actor", [u_b, u_a])):
                _fresh_process()  # a fresh worker process
                fresh = RunStore(store.root)  # no view cache: a worker opens the store from its root
                stage_files.io_counters(reset=True)
                t0 = time.perf_counter()
                for u in uris:
                    fresh.read_uri(u)
                reads[proc].append(time.perf_counter() - t0)
                io = stage_files.io_counters()
                hashed.append(io["read_bytes"])
                trusted.append(io["trusted_bytes"])
                fresh.close()
        store.close()
    med = {k: (statistics.median(t for t, _ in v), v[0][1]) for k, v in per.items()}
    written = sum(b for _, b in med.values())
    write_s = sum(t for t, _ in med.values())
    read_s = sum(statistics.median(v) for v in reads.values())
    tokens = sum(
        int(pa.compute.sum(pa.compute.list_value_length(gen.column("response_ids"))).as_py())
        for _, gen, _ in batches
    )
    return {
        "tree": args.tree or "this checkout",
        "rows_per_gen_batch": args.prompts * args.n,
        "gen_batches": args.gen_batches,
        "response_tokens_generated": tokens,
        "trained_rows": len(olp) if olp is not None else 0,
        "stages": {k: {"MB": round(b / 1e6, 2), "write_s": round(t, 3)} for k, (t, b) in med.items()},
        "written_MB_per_step": round(written / 1e6, 1),
        "write_s_per_step": round(write_s, 3),
        "write_MB_per_s": round(written / 1e6 / write_s, 1),
        "verified_read_s_per_step": {k: round(statistics.median(v), 3) for k, v in reads.items()},
        "hashed_MB_per_step": round(
            statistics.median(hashed[0::2]) / 1e6 + statistics.median(hashed[1::2]) / 1e6, 1
        ),
        "trusted_MB_per_step": round(
            statistics.median(trusted[0::2]) / 1e6 + statistics.median(trusted[1::2]) / 1e6, 1
        ),
        "storage_s_per_step": round(write_s + read_s, 3),
        "repeats": args.repeats,
    }


def hashes(args) -> dict:
    """MB/s of whole-buffer checksums on one random buffer of ``--hash-mb`` MB, interleaved rounds, medians:
    hashlib's sha256 and blake2b, zlib's crc32, and xxhash's xxh3 / google-crc32c where importable (they are
    not dependencies; install them elsewhere and put them on PYTHONPATH to compare)."""
    import contextlib
    import hashlib
    import importlib
    import zlib

    buf = np.random.default_rng(0).integers(0, 2**31, args.hash_mb * 2**20 // 4, dtype=np.int32).tobytes()
    mv = memoryview(buf)
    fns = {
        "sha256": lambda: hashlib.sha256(mv).digest(),
        "blake2b": lambda: hashlib.blake2b(mv).digest(),
        "zlib.crc32": lambda: zlib.crc32(mv),
    }
    for module, name, make in (
        ("xxhash", "xxh3_128", lambda m: lambda: m.xxh3_128(mv).digest()),
        ("xxhash", "xxh3_64", lambda m: lambda: m.xxh3_64(mv).digest()),
        ("google_crc32c", "crc32c", lambda m: lambda: m.value(buf)),
    ):
        with contextlib.suppress(ImportError):
            fns[name] = make(importlib.import_module(module))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {
        "buffer_MB": round(len(buf) / 1e6, 1),
        "MB_per_s": {k: round(len(buf) / 1e6 / statistics.median(v)) for k, v in times.items()},
        "load": os.getloadavg()[0],
        "repeats": args.repeats,
    }


def main() -> None:
    """Run the benchmark and print one JSON object with the medians."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to create the run store (default: a temp dir)")
    ap.add_argument("--step", action="store_true", help="a DAPO step's stage chain (module docstring)")
    ap.add_argument("--resp-len", type=int, default=512, help="--step: the longest response")
    ap.add_argument("--gen-batches", type=int, default=3, help="--step: generation batches a step")
    ap.add_argument("--tree", default=None, help="run this checkout's store instead (e.g. a git worktree)")
    ap.add_argument("--hashes", action="store_true", help="checksum speeds instead (hashes())")
    ap.add_argument("--hash-mb", type=int, default=128, help="--hashes: the buffer's size in MiB")
    args = ap.parse_args()
    if args.hashes:
        print(json.dumps(hashes(args), indent=1))
        return
    if args.step:
        print(json.dumps(step(args), indent=1))
        return
    _use_tree(args.tree)
    from dapo_core.store import RunStore, stage_files

    table = make_batch(args.prompts, args.n, args.tokens, args.prompt_tokens)
    rows = table.num_rows
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = RunStore(tmp)
        t_write = _median_time(lambda i: store.write_stage(i, "batch", table), args.repeats)
        man = store.manifest(0, "batch")
        mb, view_mb = man["bytes"] / 1e6, table.nbytes / 1e6

        def read_fresh(i: int) -> None:
            _fresh_process()
            store.read_stage(i, "batch")

        stage_files.io_counters(reset=True)
        t_read = _median_time(read_fresh, args.repeats)
        io = stage_files.io_counters()
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
            "files_hashed": io.get("files_hashed", io["files_read"]),  # a tree before them: all hashed
            "files_trusted": io.get("files_trusted", 0),
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
        "model_32b": model_32b(mb / t_write, mb / t_read),
        "tree": args.tree or "this checkout",
        "repeats": args.repeats,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
