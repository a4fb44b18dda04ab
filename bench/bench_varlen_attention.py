"""Packed forwards on CPU: transformers' dense block-diagonal mask against `varlen_attention`'s per-row SDPA.

One packed micro-batch of `--rows` rows (lengths uniform in [len/2, 3·len/2]) through a random Qwen2
(hidden 256, 4 layers, 8 query / 2 KV heads of 32), the LM head on the last half of each row.
Two attention paths over the same tokens and weights:

- `dense`: the model on SDPA, `attention_mask=None` and per-row position ids, so transformers builds an (N, N)
  block-diagonal boolean mask and SDPA runs over all N keys (the packed path without `packed_attention`);
- `varlen`: inside `varlen_attention.packed_attention` (one causal SDPA per row, no mask).

Times a no-grad forward (the log-prob pass) and forward + backward (the update), median of `--repeats` after
one warm-up, in float32 and bfloat16 weights, and the largest log-prob gap between the paths.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/bench_varlen_attention.py` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dapo_core.compute.microbatch import pack_rows
from dapo_core.compute.models import build_tiny_model, load_model
from dapo_core.compute.varlen_attention import packed_attention

MODEL = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def batch(rows: int, mean_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
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


def run(model: torch.nn.Module, packed, varlen: bool, grad: bool) -> torch.Tensor:
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


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", dest="mean_len", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    torch.manual_seed(0)
    ids, mask, resp = batch(args.rows, args.mean_len, seed=0)
    packed = pack_rows(ids, mask, resp)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp), MODEL, seed=0)
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
                res[f"{key}_dense_s"] = timed(lambda m=dense, g=grad: run(m, packed, False, g), args.repeats)
                res[f"{key}_varlen_s"] = timed(lambda m=var, g=grad: run(m, packed, True, g), args.repeats)
            gap = (run(dense, packed, False, False) - run(var, packed, True, False)).abs().max()
            res["max_logprob_gap"] = float(gap)
            out[name] = res
            print(json.dumps({name: res}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
