"""Generation/update overlap: the share of wall time in which the rollout worker and the actor worker both run
a call, in the orders that generate ahead (async, replay-buffer: generation for step k+1 launched before step
k's update) and the sync order.

Starts a local Ray itself (the flow's `local_ray_options`: loopback, workers at normal priority), so Ray's
task timeline (`ray.timeline()`: start and end of every worker call, per worker process) outlives the flow's
workers; then trains the CPU default (`configs/tiny_cpu.yaml`, from the project's `data/` and
`models/tiny_base`) for `--steps` steps per order, and measures from the timeline between the first and the
last call of the run: each worker's busy share and the share in which both are busy. Workers are told apart
by the order of their first call: a step begins with generation (rollout worker), then its scoring (reward
worker), and only then the actor's first stage; each order runs on a Ray of its own.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_overlap.py --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two disjoint sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def calls_by_worker(events: list[dict], since_us: float) -> dict[str, list[tuple[float, float]]]:
    """Busy intervals (seconds) of each worker process from Ray's chrome-trace events after `since_us`."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") != "X" or "call" not in str(e.get("name", "")) or float(e["ts"]) < since_us:
            continue
        key = f"{e.get('pid')}/{e.get('tid')}"
        out.setdefault(key, []).append((float(e["ts"]) / 1e6, (float(e["ts"]) + float(e["dur"])) / 1e6))
    return out


def run_order(order: str, steps: int, tmp: Path, extra: list[str] | None = None) -> dict:
    """Train `steps` steps in `order` on the already started Ray; overlap figures from its timeline. `extra`:
    more overrides (the async order gets token-level rollout IS, which it requires)."""
    import ray

    from dapo_core.config import load_config, to_yaml
    from flows.dapo_train import dapo_train

    run_id = f"overlap-{order}"
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu.yaml",
        [
            f"data.train_files=[{ROOT / 'data' / 'train.parquet'}]",
            f"data.val_files=[{ROOT / 'data' / 'val.parquet'}]",
            f"trainer.models_dir={ROOT / 'models'}",
            f"trainer.runs_dir={tmp / 'runs'}",
            "trainer.use_ray=true",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.logger=[jsonl]",
            f"trainer.total_training_steps={steps}",
            f"trainer.step_order={order}",
            f"trainer.experiment_name={run_id}",
            *(["algorithm.rollout_correction.rollout_is=token"] if order == "async" else []),
            *(extra or []),
        ],
    )
    since = 0.0
    t0 = time.perf_counter()
    dapo_train(to_yaml(cfg), run_id)
    wall = time.perf_counter() - t0
    time.sleep(2)  # task events reach the GCS in batches
    busy = {k: merge(v) for k, v in calls_by_worker(ray.timeline(), since).items()}
    rows = [json.loads(x) for x in (tmp / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    gen = sum(r.get("timing_s/generate", 0.0) for r in rows)
    upd = sum(r.get("timing_s/update_actor", 0.0) + r.get("timing_s/old_log_prob", 0.0) for r in rows)
    # first calls: rollout (generate), reward (score), then the actor (old_log_prob or update)
    ranked = sorted(busy, key=lambda k: busy[k][0][0])
    if len(ranked) < 3:
        raise SystemExit(
            f"{order}: calls of {len(ranked)} worker processes in the timeline, expected 3 or more"
        )
    top = [ranked[0], ranked[2]]
    start = min(a for k in top for a, _ in busy[k])
    end = max(b for k in top for _, b in busy[k])
    span = end - start
    both = overlap(busy[top[0]], busy[top[1]]) / span
    return {
        "busy_intervals": {k: busy[k] for k in ranked},
        "flow_wall_s": wall,
        "span_s": span,
        "busy_share": [sum(b - a for a, b in busy[k]) / span for k in top],  # rollout, actor
        "both_busy_share": both,
        "step_s": [r["timing_s/step"] for r in rows if "timing_s/step" in r],
        "generate_s": gen,
        "learn_s": upd,
    }


def main(argv: list[str] | None = None) -> None:
    """Start Ray, run both orders, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--orders", default="async,replay_buffer,sync")
    ap.add_argument("--json", default="")
    ap.add_argument("overrides", nargs="*", help="config overrides for every order (key=value)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dapo-overlap-"))
    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    import ray

    from dapo_core.compute.cluster import NAMESPACE, local_ray_options

    res = {}
    for order in args.orders.split(","):
        ray.init(
            num_cpus=8,
            include_dashboard=False,
            namespace=NAMESPACE,
            log_to_driver=False,
            configure_logging=False,
            **local_ray_options(),
        )
        res[order] = run_order(order, args.steps, tmp, args.overrides)
        ray.shutdown()
    print(f"{args.steps} steps per order; shares of the span from the first to the last rollout/actor call")
    print("| order | step s (median) | rollout busy | actor busy | both busy |")
    print("|---|---|---|---|---|")
    for order, r in res.items():
        steps = sorted(r["step_s"])
        med = steps[len(steps) // 2]
        b = r["busy_share"]
        print(
            f"| {order} | {med:.2f} | {100 * b[0]:.0f} % | {100 * b[1]:.0f} % | "
            f"{100 * r['both_busy_share']:.1f} % |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
