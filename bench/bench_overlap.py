"""Generation/update overlap: the share of wall time in which the rollout worker and the actor worker both run
a call, in the orders that generate ahead (async, replay-buffer: generation for step k+1 launched before step
k's update) and the sync order, and the cores each worker kept busy.

Starts a local Ray itself (the flow's `local_ray_options`: loopback, workers at normal priority), so Ray's
task timeline (`ray.timeline()`: start and end of every worker call, per worker process) outlives the flow's
workers; then trains `--config` (default the CPU default `configs/tiny_cpu.yaml`; paths in it are read from
the project root) for `--steps` steps per order, and measures from the timeline between the first and the
last call of the run: each worker's busy share and the share in which both are busy. Workers are told apart
by the order of their first call: a step begins with generation (rollout worker), then its scoring (reward
worker), and only then the actor's first stage; each order runs on a Ray of its own. The cores a worker kept
busy are its process's CPU seconds (the run's `memory.json`, start-up included) over that span. Over the
same span: the share in which no worker runs a call (the driver, Prefect, the store and the transfers
between calls: orchestration on the critical path) and each core's idle share (/proc/stat, every 0.25 s).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_overlap.py --steps 8
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_overlap.py --config configs/smollm2_cpu.yaml \
        --steps 6 --orders async,sync --order-override async:trainer.num_threads=0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
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


class CoreSampler:
    """Per-core CPU counters from /proc/stat, sampled every `period` seconds in a thread, so that each core's
    idle share over any window of the run (epoch seconds, as Ray's timeline) can be read afterwards."""

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> list[tuple[int, int]]:
        """(idle + iowait, total) jiffies of each core."""
        out = []
        for line in Path("/proc/stat").read_text().splitlines():
            name, *vals = line.split()
            if name.startswith("cpu") and name != "cpu":
                v = [int(x) for x in vals]
                out.append((v[3] + v[4], sum(v[:8])))  # user nice system idle iowait irq softirq steal
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.read()))
            self._stop.wait(self.period)

    def __enter__(self) -> CoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def idle(self, start: float, end: float) -> list[float]:
        """Each core's idle share between the samples nearest to `start` and `end`."""
        a = min(self.samples, key=lambda x: abs(x[0] - start))[1]
        b = min(self.samples, key=lambda x: abs(x[0] - end))[1]
        return [(bi - ai) / max(1, bt - at) for (ai, at), (bi, bt) in zip(a, b, strict=True)]


def uncovered(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end) covered by none of `intervals`."""
    covered = sum(max(0.0, min(b, end) - max(a, start)) for a, b in merge(intervals))
    return (end - start) - covered


def steady_gaps(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds with no call, span) between the end of the first and the start of the last of the merged
    `intervals`: the run's start-up gap (first store commits and Prefect task runs) and its shutdown gap
    left out, every gap between steps kept."""
    m = merge(intervals)
    if len(m) < 3:
        return 0.0, 0.0
    gaps = sum(m[i + 1][0] - m[i][1] for i in range(1, len(m) - 2))
    return gaps, m[-1][0] - m[1][0]


def steady_busy(workers: list[list[tuple[float, float]]]) -> list[float]:
    """Each worker's busy share from the start of the last worker's first call (the actor's: by then the
    pipeline is full) to the end of the last call: the start-up, where the actor waits for the first batch,
    left out."""
    start = max(w[0][0] for w in workers)
    end = max(w[-1][1] for w in workers)
    span = end - start
    return [sum(max(0.0, b - max(a, start)) for a, b in w) / span if span > 0 else 0.0 for w in workers]


ALIASES = {"timing_s/gen", "timing_s/adv"}  # the reference's names for timing_s/generate and /advantage


def anatomy(rows: list[dict]) -> dict[str, float]:
    """Median seconds per step (the first step, a warm-up, left out when there are more) of each stage timer
    in `metrics.jsonl` rows, and `other` = step − Σ stages (prompt sampling, filtering, weight sync, Prefect
    tasks, the store and the driver; meaningful in the sync order only, where the stages do not overlap)."""
    steps = [r for r in rows if "timing_s/step" in r]
    steps = steps[1:] if len(steps) > 1 else steps
    keys = sorted(
        {k for r in steps for k in r if k.startswith("timing_s/") and k != "timing_s/step"} - ALIASES
    )
    out = {k.removeprefix("timing_s/"): statistics.median(r.get(k, 0.0) for r in steps) for k in keys}
    out["other"] = statistics.median(r["timing_s/step"] - sum(r.get(k, 0.0) for k in keys) for r in steps)
    out["step"] = statistics.median(r["timing_s/step"] for r in steps)
    return out


def run_order(order: str, steps: int, tmp: Path, extra: list[str] | None = None, config: str = "") -> dict:
    """Train `steps` steps of `config` in `order` on the already started Ray; overlap figures from its
    timeline. `extra`: more overrides (the async order gets token-level rollout IS, which it requires)."""
    import ray

    from dapo_core.config import load_config, to_yaml
    from flows.dapo_train import dapo_train

    run_id = f"overlap-{order}"
    cfg = load_config(
        config or ROOT / "configs" / "tiny_cpu.yaml",
        [
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
    t0, cpu0 = time.perf_counter(), time.process_time()
    with CoreSampler() as cores:
        dapo_train(to_yaml(cfg), run_id)
    wall, driver_cpu = time.perf_counter() - t0, time.process_time() - cpu0
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
    steady = steady_busy([busy[k] for k in top])
    # no worker runs a call: the driver, Prefect, the store and the transfers between calls hold the step
    calls = [iv for k in ranked for iv in busy[k]]
    idle_workers = uncovered(calls, start, end)
    steady_idle, steady_span = steady_gaps(calls)
    mem_file = tmp / "runs" / run_id / "memory.json"
    procs = json.loads(mem_file.read_text())["processes"] if mem_file.exists() else []
    cpu = {p["role"]: p.get("cpu_s") for p in procs if p.get("rank", 0) == 0}
    used = sum(c for c in cpu.values() if c is not None) + driver_cpu
    return {
        "cores": [None if cpu.get(r) is None else cpu[r] / span for r in ("rollout", "actor")],
        "cores_all": used / span,  # the workers' and the driver's CPU seconds over the span
        "driver_cpu_per_step": driver_cpu / max(1, len(rows)),
        "no_call_share": idle_workers / span,
        "no_call_steady_share": steady_idle / steady_span if steady_span else 0.0,
        "core_idle": cores.idle(start, end),
        "anatomy": anatomy(rows),
        "busy_intervals": {k: busy[k] for k in ranked},
        "flow_wall_s": wall,
        "span_s": span,
        "busy_share": [sum(b - a for a, b in busy[k]) / span for k in top],  # rollout, actor
        "both_busy_share": both,
        "steady_busy_share": steady,  # rollout, actor, from the actor's first call on
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
    ap.add_argument("--config", default="", help="training config (default configs/tiny_cpu.yaml)")
    ap.add_argument(
        "--order-override",
        action="append",
        default=[],
        metavar="ORDER:KEY=VALUE",
        help="an override for one order only, e.g. async:trainer.num_threads=0 (repeatable)",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides for every order (key=value)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # the configs' relative paths (data, models) are the project's
    per_order: dict[str, list[str]] = {}
    for item in args.order_override:
        order, sep, kv = item.partition(":")
        if not sep or "=" not in kv:
            raise SystemExit(f"--order-override {item!r}: write ORDER:KEY=VALUE")
        per_order.setdefault(order, []).append(kv)
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
        extra = [*args.overrides, *per_order.get(order, [])]
        res[order] = run_order(order, args.steps, tmp, extra, args.config)
        ray.shutdown()
    print(
        f"{args.steps} steps per order; shares of the span from the first to the last rollout/actor call "
        "(steady: from the actor's first call on)"
    )
    print(
        "| order | step s (median) | rollout busy | actor busy | both busy | rollout cores | actor cores "
        "| steady: rollout / actor busy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for order, r in res.items():
        steps = sorted(r["step_s"])
        med = steps[len(steps) // 2]
        b = r["busy_share"]
        cores = " | ".join("—" if c is None else f"{c:.2f}" for c in r["cores"])
        print(
            f"| {order} | {med:.2f} | {100 * b[0]:.0f} % | {100 * b[1]:.0f} % | "
            f"{100 * r['both_busy_share']:.1f} % | {cores} | "
            + " / ".join(f"{100 * x:.0f} %" for x in r["steady_busy_share"])
            + " |"
        )
    print()
    print(
        "seconds per step, median (step 1 left out; in the orders that generate ahead the stages overlap, so "
        "no `other`); no call: share of the span in which no worker runs a call (orchestration on the "
        "critical path; in brackets without the start-up and shutdown gaps); driver CPU: the flow's own CPU "
        "seconds per step, start-up included; cores: the workers' and driver's CPU over the span; idle per "
        "core: /proc/stat over the span"
    )
    keys = sorted({k for r in res.values() for k in r["anatomy"] if k not in ("step", "other")})
    print(
        "| order | step | "
        + " | ".join(keys)
        + " | other | no call | driver CPU | cores busy | idle per core |"
    )
    print("|---|---|" + "---|" * len(keys) + "---|---|---|---|---|")
    for order, r in res.items():
        a = r["anatomy"]
        cells = " | ".join(f"{a.get(k, 0.0):.2f}" for k in keys)
        other = f"{a['other']:.2f}" if order == "sync" else "—"
        idle = " / ".join(f"{100 * x:.0f} %" for x in r["core_idle"])
        print(
            f"| {order} | {a['step']:.2f} | {cells} | {other} | {100 * r['no_call_share']:.1f} % "
            f"({100 * r['no_call_steady_share']:.2f} %) | "
            f"{r['driver_cpu_per_step']:.2f} | {r['cores_all']:.2f} | {idle} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
