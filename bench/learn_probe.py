"""Learning probe: does DAPO visibly raise held-out accuracy of the tiny CPU model within ~10 minutes?

End to end, in one process with one torch thread:
  build a tiny Qwen2 model + char tokenizer (dapo_core.compute.models) → supervised warm-up
  (dapo_core.compute.sft) → held-out evaluation → DAPO steps → held-out evaluation, printing accuracy
  before/after and wall time.

The DAPO step here is deliberately self-contained and small (it is a benchmark of *learnability*, not the
product's training loop): sample n responses per prompt with HF ``generate``; score with
``math_dapo.compute_score`` (a local copy of its integer path when ``dapo_core.rewards`` is absent);
dynamic sampling (keep groups whose ``acc`` has non-zero spread, refill up to ``--max-gen-batches``);
GRPO advantages (unbiased std, ε=1e-6); old log-probs by a teacher-forced forward; clipped loss with
ε_low/ε_high and dual clip c, token-mean over each mini-batch; AdamW. The loss and the GRPO advantage are
small local functions here, not ``dapo_core.algo``'s.
No KL, no entropy bonus, no overlong shaping (responses are short). Evaluation is greedy (``--eval-greedy``,
default) and/or sampled mean@k at temperature 1.

Example:
  OMP_NUM_THREADS=1 .venv/bin/python bench/learn_probe.py --out /tmp/learn_probe --eval-every 20 \\
      --lr-warmup-steps 15
(defaults = run 6 of docs/LEARNING.md; the goal of +30 points is not yet met, see there)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_core.compute.models import build_tiny_model, load_tokenizer
from dapo_core.compute.sft import carry_slip_solution, synthetic_solution, warmup_sft
from dapo_core.data.datasets import make_synthetic_splits, tokenize_prompt


# ------------------------------------------------------------------------------------------ scoring
def _local_score(solution: str, ground_truth: str) -> dict:
    """Integer subset of math_dapo.compute_score (last ``Answer:`` line of the last 300 chars, spaces
    removed)."""
    matches = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", solution[-300:])
    pred = matches[-1] if matches else "[INVALID]"
    pred = pred.split("=")[-1].replace(" ", "").strip()
    ok = pred == ground_truth.replace(" ", "").strip()
    return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": pred}


try:  # the shared scorer when it has landed
    from dapo_core.rewards.math_dapo import compute_score as _score  # type: ignore
except ImportError:  # pragma: no cover - fallback while teammates build it
    _score = _local_score


# ------------------------------------------------------------------------------------------ model I/O
def load(path: Path):
    """Load the HF folder as float32 eager model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids, mask)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids, mask


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new: int,
    eos: int,
    pad: int,
    greedy: bool,
    temperature: float,
    chunk: int = 256,
) -> list[list[int]]:
    """Sample (or greedy-decode) responses; each response ends at (and includes) its first EOS."""
    out: list[list[int]] = []
    for s in range(0, len(prompts), chunk):
        ids, mask = left_pad(prompts[s : s + chunk], pad)
        kw = (
            {"do_sample": False}
            if greedy
            else {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
        )
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=pad,
            **kw,
        )
        for row in gen[:, ids.shape[1] :].tolist():
            resp = []
            for t in row:
                resp.append(t)
                if t == eos:
                    break
            out.append(resp)
    return out


def response_log_probs(
    model, prompts: list[list[int]], responses: list[list[int]], pad: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs (B, L) of right-padded responses after left-padded prompts, and the mask."""
    p_ids, p_mask = left_pad(prompts, pad)
    L = max(len(r) for r in responses)
    r_ids = torch.full((len(responses), L), pad, dtype=torch.long)
    r_mask = torch.zeros((len(responses), L), dtype=torch.long)
    for i, r in enumerate(responses):
        r_ids[i, : len(r)] = torch.tensor(r)
        r_mask[i, : len(r)] = 1
    ids = torch.cat([p_ids, r_ids], 1)
    mask = torch.cat([p_mask, r_mask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, p_ids.shape[1] - 1 : -1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, r_ids.unsqueeze(-1)).squeeze(-1)
    return lp, r_mask.float()


# ------------------------------------------------------------------------------------------ DAPO pieces
def grpo_advantages(scores: np.ndarray, group: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO outcome advantage per trajectory: (r − mean_g)/(std_g + ε), unbiased std, singletons μ=0, σ=1."""
    adv = np.zeros_like(scores, dtype=np.float64)
    for g in np.unique(group):
        m = group == g
        r = scores[m]
        mu, sd = (0.0, 1.0) if len(r) == 1 else (r.mean(), r.std(ddof=1))
        adv[m] = (r - mu) / (sd + eps)
    return adv


def dapo_loss(old_lp, lp, adv, mask, eps_low: float, eps_high: float, c: float):
    """Vanilla clipped policy loss with dual clip (docs/REFERENCE.md §1.2), token-mean over the mask."""
    neg_kl = (lp - old_lp).clamp(-20.0, 20.0)
    ratio = torch.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    lclip = torch.maximum(l1, l2)
    ldual = torch.minimum(-adv * c, lclip)
    pg = torch.where(adv < 0, ldual, lclip)
    clipfrac = ((l2 > l1).float() * mask).sum() / mask.sum()
    return (pg * mask).sum() / mask.sum(), float(clipfrac)


def evaluate(model, val_rows, prompt_cache, tok, args, *, greedy: bool, k: int = 1) -> float:
    """Held-out accuracy: greedy, or mean over k samples at the rollout temperature."""
    prompts = [prompt_cache[i] for i in range(len(val_rows))] * (1 if greedy else k)
    resp = generate(
        model,
        prompts,
        max_new=args.max_response_length,
        eos=tok.eos_token_id,
        pad=tok.pad_token_id,
        greedy=greedy,
        temperature=args.temperature,
    )
    gts = [r["reward_model"]["ground_truth"] for r in val_rows] * (1 if greedy else k)
    accs = [
        bool(_score(tok.decode(r, skip_special_tokens=True), gt)["acc"])
        for r, gt in zip(resp, gts, strict=True)
    ]
    return float(np.mean(accs))


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    """Run the probe; print and return the measured numbers."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/learn_probe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    # task
    ap.add_argument("--min-value", type=int, default=0)
    ap.add_argument("--max-value", type=int, default=99)
    ap.add_argument("--num-operands", type=int, default=2)
    ap.add_argument("--ops", default="+")
    ap.add_argument("--num-train", type=int, default=4000)
    ap.add_argument("--num-val", type=int, default=200)
    ap.add_argument("--solution", choices=["worked", "answer", "carry_slip"], default="worked")
    # model
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=512)
    # sft
    ap.add_argument("--slip-prob", type=float, default=0.6, help="for --solution carry_slip")
    ap.add_argument("--sft-steps", type=int, default=500)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument(
        "--init-from",
        default="",
        help="copy this already warmed-up model folder instead of "
        "building + SFT (for iterating on RL settings; the task args must match)",
    )
    # dapo
    ap.add_argument("--rl-steps", type=int, default=100)
    ap.add_argument("--rl-minutes", type=float, default=8.0, help="stop RL after this many minutes")
    ap.add_argument("--train-batch", type=int, default=16, help="prompts (groups) per training step")
    ap.add_argument("--gen-batch", type=int, default=16, help="prompts per generation batch")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-gen-batches", type=int, default=4)
    ap.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per training step")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument(
        "--lr-warmup-steps", type=int, default=0, help="linear lr warm-up over this many optimizer steps"
    )
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-response-length", type=int, default=24)
    ap.add_argument("--clip-low", type=float, default=0.2)
    ap.add_argument("--clip-high", type=float, default=0.28)
    ap.add_argument("--clip-c", type=float, default=10.0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument(
        "--eval-every", type=int, default=0, help="greedy eval every k RL steps (0 = only at end)"
    )
    ap.add_argument("--eval-sampled-k", type=int, default=0, help="also report sampled mean@k (0 = off)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    model_dir = out / "model"

    train_rows, val_rows = make_synthetic_splits(
        args.num_train,
        args.num_val,
        seed=args.seed,
        min_value=args.min_value,
        max_value=args.max_value,
        num_operands=args.num_operands,
        ops=tuple(args.ops),
    )
    tiny = {
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
    if args.init_from:
        shutil.copytree(args.init_from, model_dir)
        tok = load_tokenizer(model_dir)
        sft = {"loss_first": float("nan"), "loss_last": float("nan"), "wall_s": 0.0}
    else:
        build_tiny_model(model_dir, tiny, seed=args.seed)
        tok = load_tokenizer(model_dir)
        sol = {
            "worked": synthetic_solution,
            "answer": lambda r: f"Answer: {r['reward_model']['ground_truth']}",
            "carry_slip": lambda r: carry_slip_solution(r, slip_prob=args.slip_prob, seed=args.seed),
        }[args.solution]
        sft = warmup_sft(
            model_dir,
            train_rows,
            tok,
            steps=args.sft_steps,
            lr=args.sft_lr,
            batch_size=args.sft_batch,
            seed=args.seed,
            solution_fn=sol,
        )
        shutil.copytree(model_dir, out / "sft_model")
    t_sft = time.perf_counter() - t_start
    print(
        f"[probe] sft {args.sft_steps} steps loss {sft['loss_first']:.3f}->{sft['loss_last']:.3f} "
        f"in {sft['wall_s']:.1f}s",
        flush=True,
    )

    model = load(model_dir)
    model.eval()
    val_prompts = {i: tokenize_prompt(tok, r["prompt"]) for i, r in enumerate(val_rows)}
    train_prompts = [tokenize_prompt(tok, r["prompt"]) for r in train_rows]
    train_gts = [r["reward_model"]["ground_truth"] for r in train_rows]
    t0 = time.perf_counter()
    acc_before = evaluate(model, val_rows, val_prompts, tok, args, greedy=True)
    samp_before = (
        evaluate(model, val_rows, val_prompts, tok, args, greedy=False, k=args.eval_sampled_k)
        if args.eval_sampled_k
        else None
    )
    t_eval = time.perf_counter() - t0
    print(
        f"[probe] before RL: greedy acc {acc_before:.3f} sampled {samp_before} (eval {t_eval:.1f}s)",
        flush=True,
    )

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda k: min(1.0, (k + 1) / args.lr_warmup_steps) if args.lr_warmup_steps > 0 else 1.0
    )
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    order, cursor = rng.permutation(len(train_rows)), 0
    curve = [(0, acc_before)]
    t_rl0 = time.perf_counter()
    step = 0
    gen_batches_total = 0
    for step in range(1, args.rl_steps + 1):
        if time.perf_counter() - t_rl0 > args.rl_minutes * 60:
            step -= 1
            break
        kept_p, kept_r, kept_s, kept_g = [], [], [], []
        n_kept, n_gen, accs = 0, 0, []
        while n_kept < args.train_batch:
            n_gen += 1
            if n_gen > args.max_gen_batches:
                break  # train on what we have (the product raises; a probe keeps going)
            if cursor + args.gen_batch > len(order):
                order, cursor = rng.permutation(len(train_rows)), 0
            pids = order[cursor : cursor + args.gen_batch]
            cursor += args.gen_batch
            prompts = [train_prompts[i] for i in pids for _ in range(args.n)]
            model.eval()
            resp = generate(
                model,
                prompts,
                max_new=args.max_response_length,
                eos=tok.eos_token_id,
                pad=tok.pad_token_id,
                greedy=False,
                temperature=args.temperature,
            )
            sc = np.array(
                [
                    _score(tok.decode(r, skip_special_tokens=True), train_gts[i])["score"]
                    for r, i in zip(resp, np.repeat(pids, args.n), strict=True)
                ],
                dtype=np.float64,
            )
            accs.extend((sc > 0).tolist())
            for g in range(len(pids)):
                s = sc[g * args.n : (g + 1) * args.n]
                if s.std() > 0 and n_kept < args.train_batch:
                    n_kept += 1
                    kept_p += prompts[g * args.n : (g + 1) * args.n]
                    kept_r += resp[g * args.n : (g + 1) * args.n]
                    kept_s += s.tolist()
                    kept_g += [n_kept] * args.n
        n_gen = min(n_gen, args.max_gen_batches)
        gen_batches_total += n_gen
        if not kept_p:
            print(f"[probe] step {step}: no group with reward spread; skipping", flush=True)
            continue
        adv_np = grpo_advantages(np.array(kept_s), np.array(kept_g))
        with torch.no_grad():
            old_lp, mask = response_log_probs(model, kept_p, kept_r, tok.pad_token_id, args.temperature)
        adv = torch.tensor(adv_np, dtype=torch.float32)[:, None] * mask
        model.train()
        groups = np.unique(kept_g)
        mb_groups = np.array_split(rng.permutation(groups), min(args.mini_batches, len(groups)))
        clipfracs, losses = [], []
        for mb in mb_groups:
            rows = np.nonzero(np.isin(kept_g, mb))[0]
            lp, m = response_log_probs(
                model,
                [kept_p[i] for i in rows],
                [kept_r[i] for i in rows],
                tok.pad_token_id,
                args.temperature,
            )
            L = m.shape[1]
            loss, cf = dapo_loss(
                old_lp[rows, :L], lp, adv[rows, :L], m, args.clip_low, args.clip_high, args.clip_c
            )
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optim.step()
            sched.step()
            clipfracs.append(cf)
            losses.append(float(loss.detach()))
        msg = (
            f"[probe] step {step} train_acc {np.mean(accs):.3f} kept {n_kept}/{args.train_batch} "
            f"gen_batches {n_gen} loss {np.mean(losses):+.4f} clipfrac {np.mean(clipfracs):.3f} "
            f"t {time.perf_counter() - t_rl0:.0f}s"
        )
        if args.eval_every and step % args.eval_every == 0:
            model.eval()
            a = evaluate(model, val_rows, val_prompts, tok, args, greedy=True)
            curve.append((step, a))
            msg += f" val_greedy {a:.3f}"
        print(msg, flush=True)
    t_rl = time.perf_counter() - t_rl0

    model.eval()
    acc_after = evaluate(model, val_rows, val_prompts, tok, args, greedy=True)
    samp_after = (
        evaluate(model, val_rows, val_prompts, tok, args, greedy=False, k=args.eval_sampled_k)
        if args.eval_sampled_k
        else None
    )
    curve.append((step, acc_after))
    wall = time.perf_counter() - t_start
    result = {
        "acc_before": acc_before,
        "acc_after": acc_after,
        "delta": acc_after - acc_before,
        "sampled_before": samp_before,
        "sampled_after": samp_after,
        "rl_steps": step,
        "gen_batches": gen_batches_total,
        "wall_s": wall,
        "sft_s": t_sft,
        "rl_s": t_rl,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "curve": curve,
        "args": vars(args),
    }
    print(
        f"[probe] greedy acc {acc_before:.3f} -> {acc_after:.3f} (delta {acc_after - acc_before:+.3f}); "
        f"sampled {samp_before} -> {samp_after}; {step} RL steps; wall {wall:.0f}s "
        f"(sft {t_sft:.0f}s, rl {t_rl:.0f}s); load {load0[0]:.2f}->{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
