"""Held-out accuracy per wall-clock minute: our DAPO step against TRL's GRPOTrainer on the same machine.

Both sides start from the same base model folder (`models/tiny_base`, from `dapo base`) and the same parquet
(`data/train.parquet`, from `dapo prepare`), with the same batch shape (`--prompts` × `--n` trained samples
per optimizer step, one optimizer step per batch), the same learning rate (constant, no warm-up), temperature
1 and the same response length. Ours runs `dapo train` with the CPU default's DAPO settings (dynamic sampling,
overlong shaping, clip-higher, token-mean); TRL runs `bench/peer/trl_grpo.py` in `.venv-trl` (DAPO loss, clip
0.2/0.28, no KL). Each side saves its policy at training-clock marks (`--marks` seconds from its first step;
ours checkpoints every `--save-every` steps and takes the last checkpoint at or before each mark, by the wall
time from its first step's start, saves included);
afterwards every saved policy is scored by the same evaluator (our `evaluate_model`): held-out mean@4 at
temperature 1 and greedy accuracy on `data/val.parquet`.

Modes: `pinned` runs both at once, each pinned to one core (`taskset`); `whole` runs them one after the other,
each with the whole machine. `--real` is the real model's shape: `configs/smollm2_cpu.yaml`'s model
(`models/smollm2_135m`, from `dapo import-model`), data (`data/smollm2/`), prompts × samples per step,
learning rate, response length, temperature and top-p, on both sides (TRL trains in float32, or with
`--trl-bf16` in its Trainer's bf16 mixed precision; ours in the config's precision). Run (after `dapo
prepare` and `dapo base`, and `bash bench/peer/setup_trl_env.sh`): `.venv/bin/python bench/bench_vs_trl.py
--mode pinned --seeds 0,1` (about 2 × 10 minutes plus evaluation). Prints a JSON line per side, seed and
mark, then a summary: medians over seeds, and the minutes each side needs to reach the other's final
accuracy. Check /proc/loadavg: the machine must be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        RAY_USAGE_STATS_ENABLED="0",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _pin(core: str | None) -> list[str]:
    return ["taskset", "-c", core] if core is not None else []


def ours_cmd(args: argparse.Namespace, seed: int, run_id: str) -> list[str]:
    """`dapo train` with the benchmark's shape; a checkpoint every `--save-every` steps, no validation inside
    the clock."""
    a = "actor_rollout_ref"
    overrides = [
        f"{a}.model.path={args.model}",
        f"data.train_files=[{args.train}]",
        f"data.val_files=[{args.val}]",
        f"data.train_batch_size={args.prompts}",
        f"data.gen_batch_size={2 * args.prompts}",
        f"{a}.rollout.n={args.n}",
        f"{a}.actor.ppo_mini_batch_size={args.prompts}",
        f"{a}.actor.optim.lr={args.lr}",
        f"data.max_response_length={args.max_new_tokens}",
        f"{a}.rollout.temperature={args.temperature}",
        f"{a}.rollout.top_p={args.top_p}",
        f"{a}.actor.optim.lr_warmup_steps=0",
        "trainer.total_training_steps=100000",
        f"trainer.save_freq={args.save_every}",
        "trainer.max_actor_ckpt_to_keep=null",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.seed={seed}",
        f"trainer.runs_dir={args.work}/ours_runs",
        f"trainer.models_dir={args.work}/ours_models",
        f"eval.output={args.work}/ours_eval_seed{seed}.json",
        "eval.n=1",
        f"trainer.experiment_name={run_id}",
        *args.ours_overrides,
    ]
    # --flow-only: the inputs exist; the pipeline's evaluations would only delay the training clock's start
    return [str(ROOT / ".venv/bin/dapo"), "train", "--flow-only", "--config", args.config, *overrides]


def run_ours(args: argparse.Namespace, seed: int, core: str | None, threads: int) -> subprocess.Popen:
    """Start our side; returns the process (its own session, so the whole tree can be stopped)."""
    run_id = f"bench-seed{seed}"
    log = open(Path(args.work) / f"ours_seed{seed}.log", "w")  # noqa: SIM115 - closed with the process
    env = _env(threads)
    if not env.get("PREFECT_API_URL"):
        # A Prefect database of its own per seed, so every run starts from the same state: with the 700 MB
        # ~/.prefect that earlier benchmarks had left, one pair of pinned probes measured 0.27 against 0.22 s
        # of temporary-server CPU a step.
        env["PREFECT_HOME"] = str(Path(args.work).resolve() / f"prefect_home_seed{seed}")
    if args.real:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `make train-real` runs the real config
    return subprocess.Popen(
        [*_pin(core), *ours_cmd(args, seed, run_id)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def ours_steps(run_dir: Path) -> list[dict]:
    """Per logged step: its number and its step time (`timing_s/step`) from metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        {"step": int(r["step"]), "step_s": float(r["timing_s/step"])} for r in rows if "timing_s/step" in r
    ]


def ours_clock(steps: list[dict], seen: dict[int, float]) -> list[dict]:
    """Per step: training-clock seconds, the wall time from the first step's start to the moment the step's
    row was seen (`seen`, perf_counter). Our checkpoints between steps count, TRL's saves do not, so the
    clock is conservative for our side; the sum of the step times is kept as `step_clock_s`."""
    if not steps or steps[0]["step"] not in seen:
        return []
    t0 = seen[steps[0]["step"]] - steps[0]["step_s"]
    out, total = [], 0.0
    for s in steps:
        total += s["step_s"]
        if s["step"] in seen:
            out.append({"step": s["step"], "clock_s": seen[s["step"]] - t0, "step_clock_s": total})
    return out


def watch_ours(args: argparse.Namespace, seed: int, proc: subprocess.Popen) -> list[dict]:
    """Wait until our training clock passes the last mark, stop the run, return the marks' checkpoints."""
    run_dir = Path(args.work) / "ours_runs" / f"bench-seed{seed}"
    last = max(args.marks)
    seen: dict[int, float] = {}  # step -> when its metrics row was first seen (polled every 0.5 s)
    while proc.poll() is None:
        now = time.perf_counter()
        steps = ours_steps(run_dir)
        for s in steps:
            seen.setdefault(s["step"], now)
        clock = ours_clock(steps, seen)
        if clock and clock[-1]["clock_s"] >= last:
            break
        time.sleep(0.5)
    _stop(proc)
    steps = ours_clock(ours_steps(run_dir), seen)
    marks = []
    saved = {int(p.name.removeprefix("step_")) for p in (run_dir / "ckpt").glob("step_*")}
    for mark in args.marks:
        done = [s for s in steps if s["clock_s"] <= mark and s["step"] in saved]
        if done:
            s = done[-1]
            marks.append({**s, "mark_s": mark, "path": str(run_dir / "ckpt" / f"step_{s['step']}" / "actor")})
    if len(marks) == len(args.marks):  # every mark has its checkpoint: the others go (about 1.6 GB each at
        # the real shape; the runs of a session add up to tens of GB). Otherwise all stay, to look into.
        for step in saved - {m["step"] for m in marks}:
            shutil.rmtree(run_dir / "ckpt" / f"step_{step}", ignore_errors=True)
    return marks


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_trl(args: argparse.Namespace, seed: int, core: str | None, threads: int) -> subprocess.Popen:
    """Start the TRL peer in .venv-trl."""
    out = Path(args.work) / f"trl_seed{seed}"
    cmd = [
        *_pin(core),
        str(ROOT / ".venv-trl/bin/python"),
        str(ROOT / "bench/peer/trl_grpo.py"),
        "--model",
        args.model,
        "--train",
        args.train,
        "--out",
        str(out),
        "--marks",
        ",".join(str(m) for m in args.marks),
        "--prompts",
        str(args.prompts),
        "--n",
        str(args.n),
        "--lr",
        str(args.lr),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--temperature",
        str(args.temperature),
        "--top-p",
        str(args.top_p),
        "--micro",
        str(args.micro),
        "--seed",
        str(seed),
        "--threads",
        str(threads),
        *(["--bf16"] if args.trl_bf16 else []),
    ]
    log = open(Path(args.work) / f"trl_seed{seed}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(threads), stdout=log, stderr=subprocess.STDOUT)


def trl_marks(args: argparse.Namespace, seed: int) -> list[dict]:
    """The TRL peer's saved marks from its timeline."""
    path = Path(args.work) / f"trl_seed{seed}" / "timeline.json"
    return json.loads(path.read_text())["marks"] if path.exists() else []


def evaluate(args: argparse.Namespace, folder: str) -> dict[str, float]:
    """Held-out mean@4 at temperature 1 and greedy accuracy of an HF folder, by our evaluator."""
    out = {}
    for name, overrides in (
        ("mean@4", ["eval.n=4", "eval.temperature=1.0", "eval.top_p=1.0"]),
        ("greedy", ["eval.n=1", "eval.temperature=1.0", "eval.top_k=1"]),  # top-k 1 = greedy
    ):
        code = (
            "import json,sys\n"
            "from dapo_core.config import load_config, to_yaml\n"
            "from flows.evaluate import evaluate_model\n"
            "cfg = load_config(sys.argv[1], sys.argv[3:])\n"
            "m = evaluate_model.fn(to_yaml(cfg), sys.argv[2])\n"
            "print(json.dumps([v for k, v in sorted(m.items()) if '/acc/mean@' in k][0]))\n"
        )
        res = subprocess.run(
            [
                str(ROOT / ".venv/bin/python"),
                "-c",
                code,
                args.config,
                folder,
                f"data.val_files=[{args.val}]",
                *overrides,
            ],
            cwd=ROOT,
            env=_env(2),
            capture_output=True,
            text=True,
            check=True,
        )
        out[name] = float(res.stdout.strip().splitlines()[-1])
    return out


def real_shape(args: argparse.Namespace) -> None:
    """Set the shape of `configs/smollm2_cpu.yaml` (read through our config loader, so both sides follow the
    config as it is): model, data, prompts per step, samples per prompt, lr, response length and sampling."""
    sys.path.insert(0, str(ROOT))
    from dapo_core.config import load_config

    args.config = "configs/smollm2_cpu.yaml"
    cfg = load_config(ROOT / args.config)
    ro = cfg.actor_rollout_ref.rollout
    args.model = str(cfg.actor_rollout_ref.model.path)
    args.train, args.val = str(cfg.data.train_files[0]), str(cfg.data.val_files[0])
    args.prompts, args.n = int(cfg.data.train_batch_size), int(ro.n)
    args.lr = float(cfg.actor_rollout_ref.actor.optim.lr)
    args.max_new_tokens = int(cfg.data.max_response_length)
    args.temperature, args.top_p = float(ro.temperature), float(ro.top_p)
    args.micro = min(args.micro, 16)  # bounds TRL's (rows × length × 49,152) logits


def minutes_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First training-clock minute at which the piecewise-linear accuracy curve reaches `target`."""
    prev = (0.0, curve[0][1]) if curve else None
    for t, acc in curve:
        if acc >= target:
            if prev is None or prev[1] >= target or acc == prev[1]:
                return t / 60
            return (prev[0] + (target - prev[1]) * (t - prev[0]) / (acc - prev[1])) / 60
        prev = (t, acc)
    return None


def score_marks(args: argparse.Namespace, results: dict, sides: list[str], seeds: list[int]) -> None:
    """Score every saved policy of `seeds` with our evaluator (in place) and print one JSON line each."""
    for seed in seeds:
        for side in sides:
            for m in results[side][seed]:
                m.update(evaluate(args, m["path"]))
                print(json.dumps({"side": side, "seed": seed, **m}), flush=True)


def main() -> None:
    """Parse arguments, run both sides per seed, evaluate every mark, print the table and summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["pinned", "whole"], default="pinned")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--marks", default="150,300,450,600", help="training-clock seconds")
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--model", default="models/tiny_base")
    ap.add_argument("--train", default="data/train.parquet")
    ap.add_argument("--val", default="data/val.parquet")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="response length of both sides")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--micro", type=int, default=64, help="TRL: completions per forward/backward")
    ap.add_argument("--real", action="store_true", help="the real model's shape (configs/smollm2_cpu.yaml)")
    ap.add_argument("--work", default="bench/out/vs_trl")
    ap.add_argument(
        "--ours-override",
        dest="ours_overrides",
        action="append",
        default=[],
        help="extra dotted override for our side (repeatable), e.g. trainer.step_order=replay_buffer",
    )
    ap.add_argument(
        "--save-every",
        type=int,
        default=4,
        help="our checkpoint interval in steps: a mark takes the last checkpoint at or before it, so ours is "
        "scored up to this many steps early (never late); 1 is exact but each save costs wall time",
    )
    ap.add_argument("--sides", default="ours,trl", help="which sides to train (the other is skipped)")
    ap.add_argument(
        "--trl-bf16", action="store_true", help="TRL trains in its Trainer's bf16 mixed precision"
    )
    ap.add_argument(
        "--base",
        default="",
        metavar="MEAN4,GREEDY",
        help="the base model's held-out mean@4 and greedy accuracy from an earlier run on the same inputs "
        "(skips evaluating it again)",
    )
    ap.add_argument(
        "--ours-core",
        default="0",
        help="--mode pinned: the core our side runs on (TRL takes core 1); with --sides ours and core 1, two "
        "invocations at once make a simultaneous A/B of two of our configurations",
    )
    ap.add_argument(
        "--defer-eval",
        action="store_true",
        help="score the saved policies after every seed has trained (not after each seed), so that scoring "
        "never shares the machine with training (needed for two invocations at once)",
    )
    args = ap.parse_args()
    if args.real:
        real_shape(args)
    args.marks = sorted(float(m) for m in args.marks.split(","))
    work = Path(args.work).resolve()
    args.work = str(work)
    # Both sides read one snapshot of the inputs, so nothing that rewrites data/ or models/ meanwhile matters.
    inputs = work / "inputs"
    shutil.rmtree(inputs, ignore_errors=True)
    inputs.mkdir(parents=True)
    for name in ("train", "val"):
        shutil.copy(getattr(args, name), inputs / f"{name}.parquet")
        setattr(args, name, str(inputs / f"{name}.parquet"))
    shutil.copytree(args.model, inputs / "base_model")
    args.model = str(inputs / "base_model")
    if args.base:  # the base model's figures from an earlier run on the same inputs
        mean4, greedy = (float(x) for x in args.base.split(","))
        base = {"mean@4": mean4, "greedy": greedy}
    else:
        base = evaluate(args, args.model)
    print(json.dumps({"side": "base", **base}), flush=True)
    results: dict[str, dict[int, list[dict]]] = {"ours": {}, "trl": {}}
    sides = [s for s in ("ours", "trl") if s in args.sides.split(",")]
    for seed in (int(s) for s in args.seeds.split(",")):
        if args.mode == "pinned":
            ours = run_ours(args, seed, args.ours_core, 1) if "ours" in sides else None
            trl = run_trl(args, seed, "1", 1) if "trl" in sides else None
            if ours is not None:
                results["ours"][seed] = watch_ours(args, seed, ours)
            if trl is not None:
                trl.wait()
        else:
            if "ours" in sides:
                results["ours"][seed] = watch_ours(args, seed, run_ours(args, seed, None, 2))
            if "trl" in sides:
                run_trl(args, seed, None, 2).wait()
        if "trl" in sides:
            results["trl"][seed] = trl_marks(args, seed)
        if not args.defer_eval:
            score_marks(args, results, sides, [seed])
    if args.defer_eval:
        score_marks(args, results, sides, sorted(results[sides[0]]))
    summary: dict = {"mode": args.mode, "base": base}
    for side in ("ours", "trl"):
        per_mark = {}
        for mark in args.marks:
            rows = [m for runs in results[side].values() for m in runs if m["mark_s"] == mark]
            if rows:
                per_mark[mark] = {
                    k: statistics.median(r[k] for r in rows) for k in ("mean@4", "greedy", "step")
                }
        summary[side] = per_mark
    for side, other in (("ours", "trl"), ("trl", "ours")):
        if summary[side] and summary[other]:
            curve = [(0.0, base["mean@4"])] + [(t, v["mean@4"]) for t, v in sorted(summary[side].items())]
            target = summary[other][max(summary[other])]["mean@4"]
            summary[f"{side}_minutes_to_{other}_final"] = minutes_to_reach(curve, target)
    print(json.dumps({"summary": summary}, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
