"""Actor forward benchmarks: padded against packed rows, shared-prompt layouts, and packed attention on CPU.

Three measurements, one subcommand each (JSON lines; one torch thread unless `--threads`):

- `packing`: padded against packed (padding-free) forwards on a long-tailed length mix, through
  `ActorWorker`. Prompts uniform in [32, 96] tokens, responses lognormal (median `--median`, sigma `--sigma`)
  capped at `--max-resp` (the cap is hit, as DAPO's 20,480 is). `log-probs` (`compute_log_prob`, no grad):
  padded = micro-batches of `--micro` rows, each padded to its own longest row; packed = `use_remove_padding`
  + `log_prob_max_token_len=--budget`. `update` (`update_actor`: forward + backward + AdamW over one
  mini-batch): padded = micro-batches of `--micro` rows padded to the batch's width (what `ppo_update`
  slices); packed = `use_dynamic_bsz` with `ppo_max_token_len_per_gpu=--budget` + `use_remove_padding`.
  Reports valid tokens, tokens the forward processed, the share of padding, seconds (median of `--repeats`)
  and valid tokens/s, then a markdown table. Packed attention runs one causal SDPA per row
  (`dapo_core.compute.varlen_attention`): Σ len² per micro-batch, no (N, N) mask. 2-4 minutes on 2 cores.
- `shared-prompt`: shared-prompt forwards (`use_shared_prompt`) against the per-row padded forward, through
  `ActorWorker`. A GRPO/DAPO batch is `prompts × n` rows whose n responses share their prompt; the per-row
  forward runs every prompt n times, the shared forward each distinct prompt of a micro-batch once, as
  `grouped` (one row per prompt group, the responses back to back under a 4-D mask), `cache` (the prompts
  with a KV cache, the responses on copies of it; forced with a zero mask budget) or `grouped_first`
  (`grouped` with the prompt groups of a mini-batch in the order of their first row, not longest first).
  The batch has the CPU default's shape (`--prompts` × `--n`, prompts of `--prompt-min`..`--prompt-max`
  tokens, responses lognormal around `--response-median`, capped at `--response-max`); `--order balanced`
  puts its rows in `trainer.balance_batch`'s length order, `--no-group-micro` leaves the micro-batches in
  that order. `compute_log_prob` and `update_actor`, interleaved, medians of `--repeats`. About a minute.
- `varlen`: one packed micro-batch of `--rows` rows (lengths uniform in [len/2, 3·len/2]) through a random
  Qwen2 (hidden 256, 4 layers, 8 query / 2 KV heads of 32), the LM head on the last half of each row:
  `dense` (the model on SDPA with `attention_mask=None` and per-row position ids, so transformers builds an
  (N, N) block-diagonal mask) against `varlen` (inside `varlen_attention.packed_attention`: one causal SDPA
  per row, no mask). A no-grad forward and forward + backward, median of `--repeats` after a warm-up, per
  dtype of `--dtypes`, and the largest log-prob gap between the paths. About a minute.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/bench_forward.py {packing,shared-prompt,varlen} [options]`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from dapo_core.compute import microbatch
from dapo_core.compute.engines import ppo as ppo_loop
from dapo_core.compute.microbatch import pack_rows, token_budget_split
from dapo_core.compute.models import build_tiny_model, load_model
from dapo_core.compute.varlen_attention import packed_attention
from dapo_core.compute.workers import actor as actor_worker
from dapo_core.compute.workers.actor import ActorWorker
from dapo_core.config import load_config
from dapo_core.config.schema import ActorConfig
from dapo_core.data import batch as B

PACKING_MODEL = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}

VARLEN_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn` after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- packing: padded against packed forwards ----------------------------------------------------------------


def make_table(rows: int, median: float, sigma: float, max_resp: int, seed: int) -> pa.Table:
    """Prompts uniform in [32, 96], responses lognormal(median, sigma) capped at max_resp; rewards random."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(32, 97, size=rows)
    rlens = np.minimum(np.maximum(rng.lognormal(np.log(median), sigma, size=rows).astype(int), 1), max_resp)
    prompts = [rng.integers(4, 99, size=p).tolist() for p in plens]
    responses = [rng.integers(4, 99, size=r).tolist() for r in rlens]
    return pa.table(
        {
            "prompt_ids": pa.array(prompts, type=pa.list_(pa.int32())),
            "response_ids": pa.array(responses, type=pa.list_(pa.int32())),
            "old_log_probs": pa.array(
                [(-4.6 + 0.1 * rng.standard_normal(r)).tolist() for r in rlens], type=pa.list_(pa.float32())
            ),
            "advantages": pa.array(
                [[float(a)] * int(r) for a, r in zip(rng.standard_normal(rows), rlens, strict=True)],
                type=pa.list_(pa.float32()),
            ),
        }
    )


def processed_tokens(plens: np.ndarray, rlens: np.ndarray, groups: list[list[int]], own_width: bool) -> int:
    """Tokens the forwards process: each group padded to its own longest prompt/response, or to the
    batch's."""
    if not own_width:
        return len(plens) * int(plens.max() + rlens.max())
    return sum(len(g) * int(plens[g].max() + rlens[g].max()) for g in groups)


def run_packing(args: argparse.Namespace) -> None:
    """Padded and packed log-probs and update through `ActorWorker`; JSON lines and a table."""
    torch.set_num_threads(1)
    table = make_table(args.rows, args.median, args.sigma, args.max_resp, args.seed)
    plens = np.array([len(x) for x in table.column("prompt_ids").to_pylist()])
    rlens = np.array([len(x) for x in table.column("response_ids").to_pylist()])
    valid = int(plens.sum() + rlens.sum())
    actor_cfg = dataclasses.asdict(
        ActorConfig(ppo_mini_batch_size=args.rows, ppo_micro_batch_size_per_gpu=args.micro)
    )
    actor_cfg["optim"]["lr"] = 1e-6
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(tmp, PACKING_MODEL, seed=0)

        def worker(dynamic: bool, packed: bool) -> ActorWorker:
            cfg = {**actor_cfg, "use_dynamic_bsz": dynamic, "ppo_max_token_len_per_gpu": args.budget}
            return ActorWorker(
                str(model),
                cfg,
                pad_token_id=0,
                temperature=1.0,
                rollout_n=1,
                total_steps=100,
                log_prob_micro_batch_size=args.micro,
                log_prob_max_token_len=args.budget if dynamic else None,
                use_remove_padding=packed,
            )

        fixed = [list(range(s, min(s + args.micro, args.rows))) for s in range(0, args.rows, args.micro)]
        packed_groups = token_budget_split(plens + rlens, args.budget)
        for path in ("log-probs", "update"):
            for name, dynamic, packed in (("padded", False, False), ("packed", True, True)):
                w = worker(dynamic, packed)
                if path == "log-probs":
                    seconds = timed(
                        lambda w=w: w.compute_log_prob(table, calculate_entropy=True), args.repeats
                    )
                    proc = valid if packed else processed_tokens(plens, rlens, fixed, own_width=True)
                else:
                    seconds = timed(lambda w=w: w.update_actor(table, 0), args.repeats)
                    proc = valid if packed else processed_tokens(plens, rlens, fixed, own_width=False)
                row = {
                    "path": path,
                    "forward": name,
                    "valid_tokens": valid,
                    "processed_tokens": proc,
                    "padding_share": round(1 - valid / proc, 3),
                    "micro_batches": len(packed_groups) if packed else len(fixed),
                    "seconds": round(seconds, 3),
                    "valid_tokens_per_s": round(valid / seconds, 1),
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    print(
        f"\nlength mix: {args.rows} rows, prompts 32-96, responses lognormal(median {args.median:g}, sigma "
        f"{args.sigma:g}) capped at {args.max_resp}: mean response {rlens.mean():.0f}, max {rlens.max()}, "
        f"{int((rlens == args.max_resp).sum())} at the cap"
    )
    print("| path | forward | processed tokens | padding share | micro-batches | s | valid tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['path']} | {r['forward']} | {r['processed_tokens']:,} | {r['padding_share']:.1%} | "
            f"{r['micro_batches']} | {r['seconds']} | {r['valid_tokens_per_s']:,.0f} |"
        )
    for path in ("log-probs", "update"):
        pad, pk = (r for r in results if r["path"] == path)
        print(f"{path}: packed is {pad['seconds'] / pk['seconds']:.2f}x the padded tokens/s")


# --- shared-prompt: per-row against shared-prompt layouts ---------------------------------------------------


def tiny_shape() -> dict:
    """`configs/tiny_cpu.yaml`'s model shape."""
    return dict(load_config("configs/tiny_cpu.yaml", [])["actor_rollout_ref"]["model"]["tiny"])


def shared_prompt_table(args: argparse.Namespace) -> pa.Table:
    """`--prompts` × `--n` rows, the n rows of a prompt sharing it, in `--order`."""
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    prompts, responses, adv = [], [], []
    for _ in range(args.prompts):
        plen = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=g))
        prompt = torch.randint(4, 99, (plen,), generator=g).tolist()
        a = float(torch.randn(1, generator=g))
        for _ in range(args.n):
            drawn = round(rng.lognormal(np.log(args.response_median), 0.35))
            rlen = int(min(args.response_max, max(1, drawn)))
            prompts.append(prompt)
            responses.append(torch.randint(4, 99, (rlen,), generator=g).tolist())
            adv.append([a] * rlen)
    table = pa.table({"prompt_ids": prompts, "response_ids": responses, "advantages": adv})
    if args.order == "balanced":
        seqlens = B.prompt_lengths(table) + B.response_lengths(table)
        table = table.take(pa.array(B.balance_order(seqlens, dp_size=1)))
    return table


@contextlib.contextmanager
def layout(path: str, group_micro: bool) -> Iterator[None]:
    """Run the shared forwards in `path`'s layout ("cache": a zero mask budget declines every grouping;
    "grouped_first": prompt groups in the order of their first row, not longest first) and, without
    `group_micro`, leave fixed-size micro-batches in the batch's own order."""
    saved = (microbatch.MAX_GROUP_MASK_ELEMENTS, ppo_loop.grouped_order, actor_worker.grouped_order)
    if path == "cache":
        microbatch.MAX_GROUP_MASK_ELEMENTS = 0
    if path == "grouped_first":

        def first_row_order(keys: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
            return microbatch.grouped_order(keys)

        ppo_loop.grouped_order = actor_worker.grouped_order = first_row_order
    if not group_micro:

        def batch_order(keys: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
            return torch.arange(keys.numel())

        ppo_loop.grouped_order = actor_worker.grouped_order = batch_order
    try:
        yield
    finally:
        microbatch.MAX_GROUP_MASK_ELEMENTS, ppo_loop.grouped_order, actor_worker.grouped_order = saved


def run_shared_prompt(args: argparse.Namespace) -> None:
    """Log-probs and update seconds per layout, interleaved; JSON lines."""
    torch.set_num_threads(args.threads)
    table = shared_prompt_table(args)
    cfg = ActorConfig(ppo_mini_batch_size=args.prompts, ppo_micro_batch_size_per_gpu=args.micro)
    actor_cfg = dataclasses.asdict(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=5e-5)))
    paths = {"per_row": False, "cache": True, "grouped_first": True, "grouped": True}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, tiny_shape(), seed=0)
        workers = {
            name: ActorWorker(
                str(path),
                actor_cfg,
                pad_token_id=0,
                temperature=1.0,
                rollout_n=args.n,
                total_steps=10 * args.repeats + 10,
                log_prob_micro_batch_size=args.micro,
                use_shared_prompt=share,
            )
            for name, share in paths.items()
        }
        times: dict[str, dict[str, list[float]]] = {k: {"log_probs": [], "update": []} for k in workers}
        for i in range(args.repeats + 1):  # the first round warms up and is left out
            for name, w in workers.items():
                with layout(name, not args.no_group_micro):
                    t = time.perf_counter()
                    w.compute_log_prob(table)
                    t_lp = time.perf_counter() - t
                    t = time.perf_counter()
                    w.update_actor(table, i + 1, pi_old="current")
                    t_up = time.perf_counter() - t
                if i:
                    times[name]["log_probs"].append(t_lp)
                    times[name]["update"].append(t_up)
    rlens = B.response_lengths(table)
    print(
        json.dumps(
            {
                "rows": table.num_rows,
                "order": args.order,
                "group_micro": not args.no_group_micro,
                "response_mean": round(float(np.mean(rlens)), 1),
                "response_max": int(np.max(rlens)),
            }
        )
    )
    for name, t in times.items():
        print(
            json.dumps(
                {
                    "path": name,
                    "log_probs_s": round(statistics.median(t["log_probs"]), 3),
                    "update_s": round(statistics.median(t["update"]), 3),
                }
            )
        )


# --- varlen: dense block-diagonal mask against per-row SDPA -------------------------------------------------


def varlen_batch(rows: int, mean_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts and right-padded responses: each row's length uniform in [len/2, 3·len/2]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean_len // 2, 3 * mean_len // 2 + 1, (rows,), generator=g)
    prompt = int(lengths.max()) // 2
    resp = int(lengths.max()) - prompt + 1
    ids = torch.randint(4, 90, (rows, prompt + resp), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        p = n // 2
        mask[i, prompt - p : prompt + (n - p)] = 1
    return ids.masked_fill(mask == 0, 0), mask, resp


def packed_forward(model: torch.nn.Module, packed, varlen: bool, grad: bool) -> torch.Tensor:
    """One packed forward (and backward with `grad`); returns the log-probs of the kept positions."""
    kw = {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "attention_mask": None,
        "use_cache": False,
        "logits_to_keep": packed.logit_index,
    }
    with torch.set_grad_enabled(grad):
        if varlen:
            with packed_attention(model, packed.cu_seqlens, packed.max_seqlen, "cpu") as extra:
                logits = model(**kw, **extra).logits[0]
        else:
            logits = model(**kw).logits[0]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, packed.input_ids[0, packed.label_index, None])
        if grad:
            lp.sum().backward()
            model.zero_grad(set_to_none=True)
    return lp.detach()[:, 0]


def run_varlen(args: argparse.Namespace) -> None:
    """Dense-mask and per-row packed forwards (and backwards) per dtype; JSON lines."""
    torch.manual_seed(0)
    ids, mask, resp = varlen_batch(args.rows, args.mean_len, seed=0)
    packed = pack_rows(ids, mask, resp)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp), VARLEN_MODEL, seed=0)
        out = {"tokens": int(packed.input_ids.shape[1]), "rows": args.rows}
        out["threads"] = torch.get_num_threads()
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            dense, var = load_model(path, dtype=dtype), load_model(path, dtype=dtype)
            dense.train()
            var.train()
            res: dict[str, float] = {}
            for grad in (False, True):
                key = "fwd_bwd" if grad else "fwd"
                res[f"{key}_dense_s"] = timed(
                    lambda m=dense, g=grad: packed_forward(m, packed, False, g), args.repeats
                )
                res[f"{key}_varlen_s"] = timed(
                    lambda m=var, g=grad: packed_forward(m, packed, True, g), args.repeats
                )
            gap = (
                packed_forward(dense, packed, False, False) - packed_forward(var, packed, True, False)
            ).abs()
            res["max_logprob_gap"] = float(gap.max())
            out[name] = res
            print(json.dumps({name: res}), flush=True)
    print(json.dumps(out))


def main() -> None:
    """Parse the subcommand and its arguments, run it."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="bench", required=True)

    pk = sub.add_parser("packing", help="padded against packed log-probs and update (ActorWorker)")
    pk.add_argument("--rows", type=int, default=64)
    pk.add_argument("--median", type=float, default=96.0)
    pk.add_argument("--sigma", type=float, default=1.0)
    pk.add_argument("--max-resp", type=int, default=1024)
    pk.add_argument("--micro", type=int, default=8, help="rows per padded micro-batch")
    pk.add_argument("--budget", type=int, default=2048, help="token budget of a packed micro-batch")
    pk.add_argument("--repeats", type=int, default=3)
    pk.add_argument("--seed", type=int, default=0)
    pk.set_defaults(run=run_packing)

    sp = sub.add_parser("shared-prompt", help="per-row against shared-prompt forwards (ActorWorker)")
    sp.add_argument("--prompts", type=int, default=32)
    sp.add_argument("--n", type=int, default=8)
    sp.add_argument("--prompt-min", type=int, default=44)
    sp.add_argument("--prompt-max", type=int, default=45)
    sp.add_argument("--response-median", type=float, default=14.0)
    sp.add_argument("--response-max", type=int, default=32)
    sp.add_argument("--order", choices=["grouped", "balanced"], default="balanced")
    sp.add_argument("--no-group-micro", action="store_true", help="micro-batches in the batch's own order")
    sp.add_argument("--micro", type=int, default=64, help="ppo_micro_batch_size_per_gpu (rows)")
    sp.add_argument("--repeats", type=int, default=5)
    sp.add_argument("--threads", type=int, default=1)
    sp.set_defaults(run=run_shared_prompt)

    vl = sub.add_parser("varlen", help="dense block-diagonal mask against per-row SDPA, packed rows")
    vl.add_argument("--rows", type=int, default=8)
    vl.add_argument("--len", dest="mean_len", type=int, default=200)
    vl.add_argument("--repeats", type=int, default=5)
    vl.add_argument("--dtypes", default="float32,bfloat16")
    vl.set_defaults(run=run_varlen)

    args = ap.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
