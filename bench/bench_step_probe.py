"""Our side of the TRL benchmark for a few steps: median stage timings at the benchmark's shape.

Runs `dapo train` with `bench_vs_trl.ours_cmd`'s overrides (32 prompts × 8, lr 5e-5, a checkpoint every
`--save-every` steps, 4 as in the benchmark) for `--steps` steps, plus any extra `key=value` overrides, then
prints the medians of every `timing_s/*` metric over the steps after the first five, the mean number of
generation batches and the mean score. `--core 0 --threads 1` is the benchmark's pinned mode; the default is
the whole machine. Use it to A/B a change quickly: run the two variants at the same time, one per core
(`--core 0` and `--core 1`), then swapped, or alternate them in one sitting, since the host's speed drifts
between runs.

Run: `.venv/bin/python bench/bench_step_probe.py --name base --steps 40` (about 1.5 minutes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_vs_trl  # noqa: E402 - the benchmark's own command line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="names the work folder bench/out/probe_<name>")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS for our processes")
    ap.add_argument("--core", default=None, help="pin to these cores (taskset -c), e.g. 0")
    ap.add_argument("--model", default=str(ROOT / "models/tiny_base"))
    ap.add_argument("--train", default=str(ROOT / "data/train.parquet"))
    ap.add_argument("--val", default=str(ROOT / "data/val.parquet"))
    ap.add_argument("--save-every", type=int, default=4, help="checkpoint interval (the benchmark's default)")
    ap.add_argument("overrides", nargs="*", help="extra dotted key=value overrides")
    args = ap.parse_args()
    work = ROOT / "bench" / "out" / f"probe_{args.name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shape = argparse.Namespace(
        model=args.model,
        train=args.train,
        val=args.val,
        prompts=32,
        n=8,
        lr=5e-5,
        ours_overrides=[],
        save_every=args.save_every,
        work=str(work),
        config="configs/tiny_cpu.yaml",
    )
    cmd = [
        c
        for c in bench_vs_trl.ours_cmd(shape, 0, "probe")
        if not c.startswith("trainer.total_training_steps")
    ]
    cmd += [f"trainer.total_training_steps={args.steps}", *args.overrides]
    if args.core is not None:
        cmd = ["taskset", "-c", args.core, *cmd]
    with open(work / "log.txt", "w") as log:
        rc = subprocess.run(
            cmd, cwd=ROOT, env=bench_vs_trl._env(args.threads), stdout=log, stderr=subprocess.STDOUT
        ).returncode
    metrics = work / "ours_runs" / "probe" / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        raise SystemExit(f"dapo train exited with {rc}; see {work / 'log.txt'}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r][5:]
    out: dict[str, float | int | str] = {"name": args.name, "steps": len(rows)}
    for key in sorted({k for r in rows for k in r if k.startswith("timing_s/")}):
        out[key.removeprefix("timing_s/")] = round(statistics.median(r.get(key, 0.0) for r in rows), 3)
    for key in ("train/num_gen_batches", "critic/score/mean"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = round(statistics.mean(values), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
