"""The TRL peer of `bench/bench_vs_trl.py`: TRL's GRPOTrainer (DAPO loss) on our base model and data.

Runs in its own environment (`.venv-trl`, built by `bench/peer/setup_trl_env.sh`; TRL is a benchmark peer,
never a dependency of the project). Reads the verl-schema parquet our `dapo prepare` writes, scores
completions with our own scorer (`dapo_core.rewards.scoring.default_compute_score`, the same function our
reward worker calls), and saves the policy as an HF folder at each wall-clock mark (`--marks` minutes,
measured from the first training step; the time spent saving is taken off the clock). Writes
`<out>/timeline.json`: per optimizer step the training-clock seconds, and per mark the folder saved.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from dapo_core.rewards.scoring import default_compute_score


def load_rows(path: str) -> Dataset:
    """Our verl-schema parquet as a TRL conversational dataset (prompt messages + scoring columns)."""
    rows = pq.read_table(path).to_pylist()
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": m["role"], "content": m["content"]} for m in r["prompt"]],
                "ground_truth": str(r["reward_model"]["ground_truth"]),
                "data_source": r["data_source"],
            }
            for r in rows
        ]
    )


def dapo_reward(completions, ground_truth, data_source, **_) -> list[float]:
    """Our scorer's `score` (+1 correct / -1 wrong) for each completion."""
    out = []
    for c, gt, src in zip(completions, ground_truth, data_source, strict=True):
        text = c[-1]["content"] if isinstance(c, list) else c
        res = default_compute_score(src, text, gt)
        out.append(float(res["score"]) if isinstance(res, dict) else float(res))
    return out


class WallClockMarks(TrainerCallback):
    """Save the model when the training clock passes each mark; stop after the last one."""

    def __init__(self, out: Path, marks_s: list[float]) -> None:
        self.out, self.marks = out, sorted(marks_s)
        self.t0: float | None = None
        self.paused = 0.0
        self.timeline: dict = {"steps": [], "marks": []}
        self.trainer: GRPOTrainer | None = None

    def clock(self) -> float:
        """Seconds of training since the first step began, saves excluded."""
        return 0.0 if self.t0 is None else time.perf_counter() - self.t0 - self.paused

    def on_step_begin(self, args, state, control, **kw):
        if self.t0 is None:
            self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        now = self.clock()
        self.timeline["steps"].append({"step": state.global_step, "clock_s": round(now, 3)})
        while self.marks and now >= self.marks[0]:
            mark = self.marks.pop(0)
            t = time.perf_counter()
            folder = self.out / f"mark_{int(mark)}s"
            assert self.trainer is not None
            self.trainer.save_model(str(folder))
            self.paused += time.perf_counter() - t
            self.timeline["marks"].append(
                {"mark_s": mark, "clock_s": round(now, 3), "step": state.global_step, "path": str(folder)}
            )
        if not self.marks:
            control.should_training_stop = True
        return control


def main() -> None:
    """Parse arguments, train until the last mark, write the timeline."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True, help="train parquet (verl schema)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--marks", default="150,300,450,600", help="training-clock seconds to save at")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--micro", type=int, default=64, help="completions per forward/backward")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--bf16", action="store_true", help="the Trainer's bf16 mixed precision (autocast; float32 weights)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = args.prompts * args.n
    if rows % args.micro:
        raise SystemExit(f"--prompts x --n = {rows} must be a multiple of --micro {args.micro}")
    # Like our `load_tokenizer`: the fast tokenizer of tokenizer.json (AutoTokenizer would pick Qwen2's class
    # from config.json and tokenize our character vocabulary differently).
    tok = PreTrainedTokenizerFast.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        seed=args.seed,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=rows // args.micro,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        num_iterations=1,
        max_steps=1_000_000,
        save_strategy="no",
        logging_steps=10,
        report_to=[],
        bf16=args.bf16,
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is on; our side does not recompute activations either
        dataloader_num_workers=0,
    )
    marks = WallClockMarks(out, [float(m) for m in args.marks.split(",")])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[dapo_reward],
        args=cfg,
        train_dataset=load_rows(args.train),
        processing_class=tok,
        callbacks=[marks],
    )
    marks.trainer = trainer
    trainer.train()
    (out / "timeline.json").write_text(json.dumps(marks.timeline, indent=1))


if __name__ == "__main__":
    main()
