"""Where a training step goes: per-stage medians, and orchestration = step time − Σ stage compute.

Runs the real `dapo-train` flow (ephemeral Prefect, Ray workers unless `--in-process`) on the CPU default
(`configs/tiny_cpu.yaml`) from the project's own `data/` and `models/tiny_base` (`dapo prepare`, `dapo base`;
read, never written), once per variant, and prints each variant's median step time, the median of every
`timing_s/<stage>` and the median of what no stage timer covers (sampling prompts, filtering, weight sync,
Prefect task and store bookkeeping, the driver). Steps 1 (warm-up) is left out of the medians.

Three more rows cover what `timing_s/step` does not: `loop` — the driver's wall time from one step's start to
the next one's (timestamps of `StepProgress.begin_step`, recorded by this script), `tail` = loop − step:
the step's metrics on the reward worker, `metrics.jsonl`, the progress display and the Prefect UI artifacts,
and `driver_cpu` — the driver process's CPU time (`time.process_time`, all its threads) over the same span,
which other processes' load on the machine changes far less than the wall times.
`--profile FILE` writes a cProfile of the driver process (with `--in-process`, the whole step), of CPU time
with `--profile-cpu`. `--models-dir` reads `tiny_base` from another folder than `models/`.

`--task-floor N` instead measures the floor: N calls of an empty Prefect task inside one flow, per set of task
options (none; `NO_CACHE`; a `task_run_name` template or callable; the stage tasks' options; those with
`log_prints=False` or `persist_result=False`), interleaved over `--rounds`, wall and process-CPU ms per call.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_step_anatomy.py --steps 8 --variant default= \
        --variant onpolicy=actor_rollout_ref.actor.ppo_mini_batch_size=16 \
        --variant separate=actor_rollout_ref.actor.ppo_mini_batch_size=16,SKIP_OFF

(`SKIP_OFF` stands for `actor_rollout_ref.actor.skip_old_log_prob_when_on_policy=false`.)
`--rounds 2` runs the variants A B A B … (interleaved, so machine load hits them alike) and pools the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import step_anatomy

ROOT = Path(__file__).resolve().parents[1]

SHORT = {"SKIP_OFF": "actor_rollout_ref.actor.skip_old_log_prob_when_on_policy=false"}
"""Abbreviations usable in --variant."""


STEP_STARTS: list[tuple[float, float]] = []
"""`(time.perf_counter(), time.process_time())` at every `StepProgress.begin_step` of the current variant run:
the driver's wall clock and its process CPU time (all of its threads)."""


def _record_step_starts() -> None:
    """Timestamp every step start of the driver (wraps `StepProgress.begin_step` in this process)."""
    from flows.progress import StepProgress

    if getattr(StepProgress.begin_step, "_timed", False):
        return
    inner = StepProgress.begin_step

    def begin_step(self, step: int, total: int) -> None:
        STEP_STARTS.append((time.perf_counter(), time.process_time()))
        inner(self, step, total)

    begin_step._timed = True  # type: ignore[attr-defined]
    StepProgress.begin_step = begin_step  # type: ignore[method-assign]


def run_variant(
    name: str, overrides: list[str], steps: int, runs_dir: Path, in_process: bool, models_dir: Path
) -> list[dict]:
    """Train `steps` steps of the CPU default with `overrides`; return the step rows of metrics.jsonl."""
    from dapo_core.config import load_config, to_yaml
    from flows.dapo_train import dapo_train

    run_id = f"anatomy-{name}"
    shutil.rmtree(runs_dir / run_id, ignore_errors=True)
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu.yaml",
        [
            f"data.train_files=[{ROOT / 'data' / 'train.parquet'}]",
            f"data.val_files=[{ROOT / 'data' / 'val.parquet'}]",
            f"trainer.models_dir={models_dir}",
            f"trainer.runs_dir={runs_dir}",
            f"trainer.use_ray={'false' if in_process else 'true'}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.logger=[jsonl]",
            f"trainer.total_training_steps={steps}",
            f"trainer.experiment_name={run_id}",
            "trainer.resume_mode=disable",
            *overrides,
        ],
    )
    _record_step_starts()
    STEP_STARTS.clear()
    dapo_train(to_yaml(cfg), run_id)
    lines = (runs_dir / run_id / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    rows = [r for r in rows if "timing_s/step" in r]
    for r in rows:  # step k's loop: from its start to step k+1's (the last step has none)
        k = int(r.get("step", 0))
        if 1 <= k < len(STEP_STARTS):
            r["_loop_s"] = STEP_STARTS[k][0] - STEP_STARTS[k - 1][0]
            r["_driver_cpu_s"] = STEP_STARTS[k][1] - STEP_STARTS[k - 1][1]
    return [r for r in rows if r.get("step", 0) >= 2]


def task_floor(calls: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median wall and process-CPU seconds per call of an empty Prefect task, per set of task options."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    from tasks.stage_commit import STAGE_TASK_OPTS, run_name

    def empty(run_id: str, step: int) -> None:
        return None

    stage = {**STAGE_TASK_OPTS, "task_run_name": "t-step{step}"}
    variants = {
        "no options": task(name="bare")(empty),
        "NO_CACHE": task(name="nc", cache_policy=NO_CACHE)(empty),
        "NO_CACHE + name template": task(name="nt", cache_policy=NO_CACHE, task_run_name="nt-step{step}")(
            empty
        ),
        "NO_CACHE + name callable": task(name="nf", cache_policy=NO_CACHE, task_run_name=run_name("nf"))(
            empty
        ),
        "stage task options": task(name="so", **stage)(empty),
        "stage options, log_prints=False": task(name="sl", log_prints=False, **stage)(empty),
        "stage options, persist_result=False": task(name="sp", persist_result=False, **stage)(empty),
    }

    @flow(name="task-floor", log_prints=True)
    def floor() -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for t in variants.values():
            t("r", 0)  # warm-up
        for _ in range(rounds):
            for name, t in variants.items():
                w0, c0 = time.perf_counter(), time.process_time()
                for i in range(calls):
                    t("r", i)
                out[name].append(((time.perf_counter() - w0) / calls, (time.process_time() - c0) / calls))
        return out

    res = floor()
    return {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in res.items()
    }


def main(argv: list[str] | None = None) -> None:
    """Run the variants and print one table (seconds, medians)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="run the variants this many times, interleaved")
    ap.add_argument("--variant", action="append", default=[], help="name=key=value,key=value (empty: as is)")
    ap.add_argument("--in-process", action="store_true", help="trainer.use_ray=false")
    ap.add_argument("--json", default="", help="also write the medians here")
    ap.add_argument("--models-dir", default=str(ROOT / "models"), help="where tiny_base is (read only)")
    ap.add_argument("--profile", default="", help="write a cProfile of this process here (pstats format)")
    ap.add_argument(
        "--profile-cpu", action="store_true", help="--profile counts process CPU time, not wall time"
    )
    ap.add_argument("--task-floor", type=int, default=0, help="measure N empty Prefect task calls instead")
    args = ap.parse_args(argv)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.process_time) if args.profile_cpu else cProfile.Profile()
        profiler.enable()
    variants = {}
    for v in args.variant or ["default="]:
        name, _, ov = v.partition("=")
        variants[name] = [SHORT.get(x, x) for x in ov.split(",") if x]
    tmp = Path(tempfile.mkdtemp(prefix="dapo-anatomy-"))
    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    if args.task_floor:
        floor = task_floor(args.task_floor, args.rounds)
        print(f"/proc/loadavg: {Path('/proc/loadavg').read_text().strip()}")
        print("| empty Prefect task | wall ms per call | process CPU ms per call |\n|---|---|---|")
        for name, (wall, cpu) in floor.items():
            print(f"| {name} | {1000 * wall:.1f} | {1000 * cpu:.1f} |")
        shutil.rmtree(tmp, ignore_errors=True)
        return
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, ov in variants.items():
            rows[name] += run_variant(
                name, ov, args.steps, tmp / "runs", args.in_process, Path(args.models_dir)
            )
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    result = {name: step_anatomy(r) for name, r in rows.items()}
    last = ["orchestration", "loop", "tail", "driver_cpu"]
    keys = [
        "step",
        *sorted({k for r in result.values() for k in r} - {"step", *last}),
        *[k for k in last if any(k in r for r in result.values())],
    ]
    print(f"steps per variant (after warm-up): {', '.join(f'{n} {len(r)}' for n, r in rows.items())}")
    print(f"/proc/loadavg at the end: {Path('/proc/loadavg').read_text().strip()}")
    print("| seconds (median) | " + " | ".join(result) + " |")
    print("|---|" + "---|" * len(result))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{result[n].get(k, 0.0):.3f}" for n in result) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": result, "rows": rows}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
