"""`dapo ablate` (`make ablation`): run the DAPO ablation grid (`flows.ablation`) as DVC experiments of a
lineage and print the results table.

    dapo ablate [--pipeline pipelines/smollm2/dvc.yaml] [--rows all] [--seeds 1,2] [--steps N]
                [--test-freq 5] [--jobs 1] [--dry-run]

1. `dvc repro` of the stages the experiments need that the switches do not change (for the real-model lineage:
   import, prepare), in the workspace.
2. `dvc exp show --json`: an experiment of the grid that already finished with the same parameters is not run
   again; one still queued or running is left to the queue; a failed one is removed from the queue and queued
   again.
3. `dvc exp run --queue -n <name> -s <train> <evaluate> -S ...` for each experiment left, then
   `dvc exp run --run-all -j <jobs>`, which runs the queue in temporary copies of the repository
   (`.dvc/tmp/exps/`) and waits for it (started again if the queue's worker stops: `Dvc.run_queue`). Stage
   commands reach the project's venv through `$DVC_ROOT`, which DVC sets to this repository in those copies.
4. `dvc exp show --json` again: the table (`flows.ablation.format_table`), and the `dvc plots diff` command
   that overlays the experiments' curves.

Run it again after an interruption: it picks up where the grid stopped. Each experiment holds its own run
store (`runs/` in its temporary copy), so an experiment interrupted mid-way starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml  # type: ignore[import-untyped]

from dapo_core.errors import EXIT_USER_ERROR, DapoUserError
from flows.ablation import (
    ExpRecord,
    MetricFiles,
    done_names,
    exp_records,
    format_table,
    grid,
    param_args,
    parse_rows,
    parse_seeds,
    summarize,
)

__all__ = ["AblationError", "Lineage", "main", "read_lineage", "run_ablation"]

EXP_STAGES = ("train", "evaluate")
"""The stages each experiment runs: the ones the switches change."""

DEFAULT_PIPELINE = "pipelines/smollm2/dvc.yaml"
"""The real-model lineage."""

MAX_QUEUE_RESTARTS = 3
"""How often a stalled queue (its worker stopped with experiments waiting) is started again."""


class AblationError(DapoUserError):
    """The grid cannot run or did not finish as asked."""


@dataclass(frozen=True)
class Lineage:
    """What the runner needs to know about a DVC lineage (paths relative to the repository root)."""

    pipeline: str
    """Its dvc.yaml."""
    params_file: str
    """The params file beside it, which the experiments' `-S` overrides change."""
    stages: tuple[str, ...]
    """The addresses of the stages each experiment runs (`<dvc.yaml>:train`, `<dvc.yaml>:evaluate`)."""
    metrics: MetricFiles
    """Where the table's numbers are."""
    steps: int | None
    """The params file's `trainer.total_training_steps` (the default budget)."""
    plots: tuple[str, ...] = ()
    """The dvc.yaml's own plots and the train stage's (what `dvc plots diff` overlays)."""


def _paths(entries: Any) -> list[str]:
    """The paths of a stage's `metrics:` list (plain paths or `{path: options}`)."""
    out: list[str] = []
    for e in entries or []:
        out.extend([e] if isinstance(e, str) else list(e))
    return out


def read_lineage(root: Path, pipeline: str) -> Lineage:
    """The lineage of `pipeline` (a dvc.yaml relative to `root`): it must have `train` and `evaluate` stages
    with metrics and a params.yaml beside it."""
    path = root / pipeline
    if not path.is_file():
        raise AblationError(
            f"--pipeline {pipeline}: no such file",
            fix=f"name a dvc.yaml of the repository ({DEFAULT_PIPELINE})",
        )
    spec = yaml.safe_load(path.read_text()) or {}
    stages = spec.get("stages") or {}
    folder = PurePosixPath(pipeline).parent
    missing = [s for s in EXP_STAGES if s not in stages]
    if missing:
        raise AblationError(
            f"--pipeline {pipeline} has no stage {', '.join(missing)}",
            fix="name a lineage whose dvc.yaml trains in a `train` stage and evaluates it in `evaluate`",
        )

    def rel(stage: dict, p: str) -> str:
        return os.path.normpath(folder / stage.get("wdir", ".") / p)

    train = [rel(stages["train"], p) for p in _paths(stages["train"].get("metrics"))]
    top = [k for entry in spec.get("plots") or [] for k in ([entry] if isinstance(entry, str) else entry)]
    plots = tuple(top) + tuple(rel(stages["train"], p) for p in _paths(stages["train"].get("plots")))
    evals = [rel(stages["evaluate"], p) for p in _paths(stages["evaluate"].get("metrics"))]
    sampled = [p for p in evals if "greedy" not in Path(p).name]
    greedy = [p for p in evals if "greedy" in Path(p).name]
    if not train or not sampled:
        raise AblationError(
            f"--pipeline {pipeline}: the train stage must list its metrics file (train.json) and the "
            "evaluate stage its held-out evaluation under `metrics:`",
            where=pipeline,
            fix="add them to the stages' `metrics:`",
        )
    params_file = os.path.normpath(folder / "params.yaml")
    if not (root / params_file).is_file():
        raise AblationError(
            f"--pipeline {pipeline}: no params.yaml beside it", fix="the experiments' -S overrides change it"
        )
    params = yaml.safe_load((root / params_file).read_text()) or {}
    steps = (params.get("trainer") or {}).get("total_training_steps")
    return Lineage(
        pipeline,
        params_file,
        tuple(f"{pipeline}:{s}" for s in EXP_STAGES),
        MetricFiles(train[0], sampled[0], greedy[0] if greedy else None),
        int(steps) if steps is not None else None,
        plots,
    )


def upstream_stages(root: Path, lineage: Lineage) -> list[str]:
    """The addresses of the stages the experiment stages depend on, except those (run in the workspace
    first, so every experiment starts from the same data and base model)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        out: list[str] = []
        for addr in lineage.stages:
            for stage in repo.stage.collect(addr, with_deps=True):
                dvcfile = os.path.relpath(stage.path, root)
                if dvcfile == os.path.normpath(lineage.pipeline) and stage.name in EXP_STAGES:
                    continue
                if stage.addressing not in out:
                    out.append(stage.addressing)
        return out


class Dvc:
    """The `dvc` command of this venv, run in the repository with the venv's bin first on PATH (the queue
    starts its workers as `dvc` from PATH)."""

    def __init__(self, root: Path, *, dry_run: bool = False) -> None:
        self.root = root
        self.dry_run = dry_run
        bin_dir = Path(sys.executable).parent
        self.exe = str(bin_dir / "dvc")
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def run(self, *args: str, mutates: bool = True) -> None:
        """Run `dvc args` with its output on the console; a failure raises `AblationError`."""
        print("$ dvc " + " ".join(args), flush=True)
        if self.dry_run and mutates:
            return
        code = subprocess.run([self.exe, *args], cwd=self.root, env=self.env, check=False).returncode
        if code != 0:
            raise AblationError(
                f"`dvc {' '.join(args[:3])} ...` failed with exit code {code} (its output is above)",
                where=str(self.root),
                fix="correct what it reports and run the same command again: finished experiments are kept",
            )

    def show(self, *, tries: int = 6) -> list[ExpRecord]:
        """The experiments `dvc exp show --json` reports. It is asked up to `tries` times, a second, then two,
        four... apart: it fails for a moment while a queue worker removes its temporary copy of the
        repository (".dvc/tmp/exps/tmp.../.dvc does not exist")."""
        for attempt in range(tries):
            p = subprocess.run(
                [self.exe, "exp", "show", "--json"],
                cwd=self.root,
                env=self.env,
                capture_output=True,
                text=True,
                check=False,
            )
            if p.returncode == 0:
                break
            if attempt + 1 < tries:
                time.sleep(2.0**attempt)
        if p.returncode != 0:
            raise AblationError(
                f"`dvc exp show --json` failed with exit code {p.returncode}: {p.stderr.strip()[-800:]}",
                where=str(self.root),
                fix="run it by hand to see why",
            )
        return exp_records(json.loads(p.stdout))

    def run_queue(self, jobs: int, names: set[str], *, poll_s: float = 60.0, stall_s: float = 120.0) -> None:
        """`dvc exp run --run-all -j <jobs>`: start the queue's workers and wait for the queue. The queue's
        worker can stop while experiments wait (kombu's filesystem broker, a race on its message files),
        and `--run-all` then waits for ever; so while it runs, `dvc exp show` is polled every `poll_s`
        seconds, and when experiments of `names` have been queued with none running for `stall_s` seconds,
        it is stopped and started again (a new worker), at most `MAX_QUEUE_RESTARTS` times. The poll is
        rare because `exp show` costs seconds of CPU and takes the repository's lock the experiments use."""
        args = ["exp", "run", "--run-all", "-j", str(jobs)]
        print("$ dvc " + " ".join(args), flush=True)
        if self.dry_run:
            return
        for _ in range(MAX_QUEUE_RESTARTS + 1):
            proc = subprocess.Popen([self.exe, *args], cwd=self.root, env=self.env)
            idle_since: float | None = None
            while not _ended(proc, poll_s):
                try:
                    states = [r.state for r in self.show(tries=1) if r.name in names]
                except AblationError:  # a worker removing its temporary copy: asked again at the next poll
                    continue
                if "running" in states or "queued" not in states:
                    idle_since = None
                    continue
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > stall_s:
                    print(
                        f"dapo ablate: experiments wait in the queue and none has run for {stall_s:.0f} s "
                        "(the queue's worker stopped: .dvc/tmp/exps/celery/*.out says why); starting it "
                        "again",
                        flush=True,
                    )
                    proc.terminate()
                    proc.wait()
                    break
            else:
                return
        raise AblationError(
            f"the DVC queue's worker stopped {MAX_QUEUE_RESTARTS + 1} times with experiments waiting",
            where=str(self.root / ".dvc" / "tmp" / "exps" / "celery"),
            fix="read the worker's log there, then run the same command again: finished experiments are kept",
        )


def _ended(proc: subprocess.Popen, wait_s: float) -> bool:
    """Whether `proc` ended within `wait_s` seconds (returns as soon as it does)."""
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def pending(records: Sequence[ExpRecord], names: set[str]) -> dict[str, list[str]]:
    """Per name of `names`, the states of its unfinished records: queued, running, failed (in the queue), or
    error (an experiment with an error that the queue no longer lists)."""
    out: dict[str, list[str]] = {}
    for r in records:
        if r.name in names and not r.ok:
            out.setdefault(r.name, []).append(r.state or "error")
    return out


def run_ablation(
    root: Path,
    pipeline: str,
    *,
    rows: str = "all",
    seeds: str = "1,2",
    steps: int | None = None,
    test_freq: int = 5,
    jobs: int = 1,
    dry_run: bool = False,
) -> str:
    """Run the grid (see the module docstring) and return the results table."""
    try:
        chosen_rows, chosen_seeds = parse_rows(rows), parse_seeds(seeds)
    except ValueError as e:
        raise AblationError(str(e), fix="see `dapo ablate --help`") from None
    lineage = read_lineage(root, pipeline)
    budget = steps if steps is not None else lineage.steps
    if budget is None:
        raise AblationError(
            f"{lineage.params_file} has no trainer.total_training_steps", fix="give the budget with --steps"
        )
    try:
        experiments = grid(chosen_rows, chosen_seeds, steps=budget, test_freq=test_freq)
    except ValueError as e:
        raise AblationError(str(e), fix="change --steps / --test-freq") from None
    dvc = Dvc(root, dry_run=dry_run)
    upstream = upstream_stages(root, lineage)
    if upstream:
        dvc.run("repro", *upstream)
    records = dvc.show()
    done, clashes = done_names(records, experiments, lineage.params_file)
    if clashes:
        name, diff = next(iter(clashes.items()))
        raise AblationError(
            f"experiment {name} already finished with other parameters ({'; '.join(diff[:4])})",
            where=f"`dvc exp show` of {root}",
            fix=f"remove it (`dvc exp remove {' '.join(clashes)}`) or run the grid with its parameters",
        )
    names = {e.name for e in experiments}
    waiting = pending(records, names - done)
    for name, states in waiting.items():
        for _ in (s for s in states if s == "failed"):
            dvc.run("queue", "remove", name)
    todo = [e for e in experiments if e.name not in done and "queued" not in waiting.get(e.name, [])]
    todo = [e for e in todo if "running" not in waiting.get(e.name, [])]
    print(
        f"ablation: {len(experiments)} experiments ({len(chosen_rows)} rows × {len(chosen_seeds)} seeds, "
        f"{budget} steps each): {len(done)} finished, {len(experiments) - len(done) - len(todo)} in the "
        f"queue, {len(todo)} to queue",
        flush=True,
    )
    for exp in todo:
        dvc.run(
            "exp",
            "run",
            "--queue",
            "-n",
            exp.name,
            "-s",
            *lineage.stages,
            *param_args(exp, lineage.params_file),
        )
    if len(done) < len(experiments):
        dvc.run_queue(jobs, names)
    if dry_run:
        return ""
    records = dvc.show()
    done, _ = done_names(records, experiments, lineage.params_file)
    unfinished = [e.name for e in experiments if e.name not in done]
    table = format_table(summarize(records, experiments, lineage.metrics, lineage.params_file))
    print(table, flush=True)
    if unfinished:
        raise AblationError(
            f"{len(unfinished)} experiment(s) did not finish: {', '.join(unfinished)}",
            where="`dvc queue status` (and `dvc queue logs <name>` for why)",
            fix="correct the cause and run the same command again: finished experiments are kept",
        )
    shown = " ".join(e.name for e in experiments)
    targets = f" --targets {' '.join(lineage.plots)}" if lineage.plots else ""
    print(f"curves: dvc plots diff {shown}{targets}\nall numbers: dvc exp show", flush=True)
    return table


def build_parser() -> argparse.ArgumentParser:
    """The options of `dapo ablate` (`python -m flows.ablation_run`)."""
    p = argparse.ArgumentParser(prog="dapo ablate", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`dapo ablate`'s options on `p`."""
    p.add_argument("--pipeline", default=DEFAULT_PIPELINE, help=f"the lineage (default {DEFAULT_PIPELINE})")
    p.add_argument("--rows", default="all", help="`all`, or row indices / slugs such as 0,1 (default all)")
    p.add_argument("--seeds", default="1,2", help="comma-separated seeds (default 1,2)")
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per experiment (default: the params file's)"
    )
    p.add_argument("--test-freq", type=int, default=5, help="validate every N steps: the held-out curve (5)")
    p.add_argument("--jobs", type=int, default=1, help="experiments at once (default 1: one after another)")
    p.add_argument("--dry-run", action="store_true", help="print the dvc commands, change nothing")
    p.add_argument("--debug", action="store_true", help="show full tracebacks (also DAPO_DEBUG=1)")


def run_args(args: argparse.Namespace) -> int:
    """Run the grid with parsed options: exit 0 when every experiment finished; a problem the user can fix is
    one paragraph and exit 2 (the traceback too with `--debug` or DAPO_DEBUG=1); Ctrl-C exits 130 with how to
    resume. Nothing here imports Prefect or torch: the stages' own processes do."""
    try:
        run_ablation(
            Path.cwd(),
            args.pipeline,
            rows=args.rows,
            seeds=args.seeds,
            steps=args.steps,
            test_freq=args.test_freq,
            jobs=args.jobs,
            dry_run=args.dry_run,
        )
    except DapoUserError as e:
        if args.debug or os.environ.get("DAPO_DEBUG") == "1":
            raise
        print(f"dapo ablate: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(
            "dapo ablate: stopped. Experiments already handed to the queue go on in the background "
            "(`dvc queue status`; `dvc queue kill <name>` stops one); the same command resumes the grid.",
            file=sys.stderr,
        )
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flows.ablation_run [options]`, the same as `dapo ablate`."""
    return run_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
