"""The real model's base scores on generated word problems, with the rollout engine the training uses.

Draws `--num` problems (`dapo_core.data.word_problems`, seed `--seed` + 100, so they are not the pipeline's
held-out split), builds each prompt as `--prompt` says (`chat`: `word_prompt`, the pipeline's format;
`inline`: instruction, one worked example and the question in one user message), samples `--k` answers per
problem with `HFRolloutEngine` and scores them with the DAPO verifier. Prints one JSON line: accuracy, the
share of answers with a parseable final answer and the accuracy among those, the share of problems whose
answers have reward spread (what dynamic sampling keeps), mean answer length, decode tokens/s and the load
average, plus accuracy per number of operations.

Example (the real-model table of bench/README.md):
  OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_real_base.py --num 48 --k 1 --temp 0 --ops +-
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
from dapo_core.compute.engines.rollout import SamplingParams
from dapo_core.compute.models import load_tokenizer
from dapo_core.data.datasets import tokenize_prompt
from dapo_core.data.word_problems import WORD_INSTRUCTION, make_word_problems
from dapo_core.rewards.math_dapo import INVALID, compute_score

INLINE_EXAMPLE = (
    "Example:\nQuestion: Tom has 12 pens. He gives 5 pens to a friend. Then he ends up with 2 times as many "
    "pens as before. How many pens does Tom have now?\nSolution: 12 - 5 = 7. 7 * 2 = 14.\nAnswer: 14"
)


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2_135m")
    ap.add_argument("--num", type=int, default=48, help="problems")
    ap.add_argument("--k", type=int, default=1, help="answers per problem")
    ap.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--max-ops", type=int, default=3)
    ap.add_argument("--max-value", type=int, default=9)
    ap.add_argument("--ops", default="+-", help="operators, e.g. +-*/")
    ap.add_argument("--prompt", choices=("chat", "inline"), default="chat")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    engine = HFRolloutEngine(a.model, dtype=a.dtype, seed=a.seed)
    rows = make_word_problems(
        a.num, max_value=a.max_value, max_ops=a.max_ops, ops=list(a.ops), seed=a.seed + 100
    )
    if a.prompt == "inline":
        for r in rows:
            question = r["prompt"][-1]["content"]
            r["prompt"] = [
                {"role": "user", "content": f"{WORD_INSTRUCTION}\n\n{INLINE_EXAMPLE}\n\n{question}"}
            ]
    prompts = [tokenize_prompt(tok, r["prompt"]) for r in rows]
    flat = [p for p in prompts for _ in range(a.k)]
    params = SamplingParams(temperature=a.temp, top_p=a.top_p, max_new_tokens=a.max_new, do_sample=a.temp > 0)
    load0, t0 = _load(), time.perf_counter()
    out = engine.generate(flat, params, list(range(len(flat))))
    secs = time.perf_counter() - t0
    accs, parsed, by_ops = [], [], defaultdict(list)
    tokens = 0
    for i, r in enumerate(rows):
        group = []
        for c in out[i * a.k : (i + 1) * a.k]:
            tokens += len(c.token_ids)
            s = compute_score(
                tok.decode(c.token_ids, skip_special_tokens=True), r["reward_model"]["ground_truth"]
            )
            group.append(float(s["acc"]))
            parsed.append(s["pred"] != INVALID)
        accs.append(group)
        by_ops[r["extra_info"]["num_ops"]].append(sum(group) / len(group))
    n = len(flat)
    acc = sum(map(sum, accs)) / n
    parse = sum(parsed) / n
    print(
        json.dumps(
            {
                **{k: v for k, v in vars(a).items() if k != "model"},
                "acc": round(acc, 3),
                "parse": round(parse, 3),
                "acc_among_parsed": round(acc / parse, 3) if parse else None,
                "groups_with_spread": round(sum(0 < sum(g) < len(g) for g in accs) / a.num, 3),
                "acc_by_num_ops": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_ops.items())},
                "mean_answer_tokens": round(tokens / n, 1),
                "decode_tokens_per_s": round(tokens / secs, 1),
                "secs": round(secs, 1),
                "load": f"{load0}->{_load()}",
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            }
        )
    )


if __name__ == "__main__":
    main()
