"""Faults injected on purpose, for tests: the `DAPO_FAULT` switch, off and inert unless the variable is set.

`DAPO_FAULT` is a comma-separated list of items, each

    [<action>@]<stage>[#<rank>]:<step>[:<run id pattern>]

- `action`: `fail` (the default) makes the driver's stage task raise before computing, on the Prefect flow
  run's first attempt only (`tasks.faults.injected_fault`). The others act in the *worker process* that runs
  the stage: `kill` SIGKILLs it (a real process death), `hang` puts it to sleep for good (a stage that never
  returns, `trainer.stage_timeout_s`). `kill` and `hang` act once per run: a marker file in
  `<run folder>/faults/` is written before they act, so a restarted or resumed run passes; `kill-always` and
  `hang-always` act on every attempt (a deterministic crash).
- `stage`: the run store's stage name (`generate_g0`, `reward_g1`, `old_log_prob`, `ref`, `values`,
  `update_actor`, `update_critic`; the updates of every local-update part). A rollout replica's share
  (`generate_g0_r1of2`) counts as its stage, with the replica's index as its rank.
- `rank`: the data-parallel rank (or replica) that acts; default 0.
- `step`: the train step.
- `run id pattern`: shell-style; the item applies only to runs whose id matches.

Examples: `kill@generate_g0:2`, `kill-always@update_actor#1:1`, `hang@reward_g0:1,kill@old_log_prob:2`,
`update_actor:2:nightly-*`.

`kill` acts only inside a Ray worker process (an in-process worker would take the driver with it); `hang`
also holds an in-process worker, and with it the driver, until the process is killed (a run held at a known
point, e.g. for a test of losing its host). The workers call `fault_point` as a stage starts; a local Ray's
workers inherit the driver's environment.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

__all__ = ["FAULT_ENV", "FaultSpec", "fault_point", "faults_from_env", "parse_faults"]

FAULT_ENV = "DAPO_FAULT"
"""The environment variable that injects faults (grammar in the module docstring)."""

ACTIONS = ("fail", "kill", "kill-always", "hang", "hang-always")
"""What an item does: fail in the driver, or kill / hang the worker process (once, or every time)."""

MARKER_DIR = "faults"
"""The folder of the run where a once-only fault records that it acted."""

_ITEM = re.compile(
    r"^(?:(?P<action>[a-z-]+)@)?(?P<stage>[a-z0-9_]+)(?:#(?P<rank>\d+))?:(?P<step>\d+)(?::(?P<run>[^:,]+))?$"
)
_SHARE = re.compile(r"^(?P<stage>[a-z0-9_]+)_r(?P<index>\d+)of\d+$")
_GRAMMAR = (
    "expected a comma-separated list of [<action>@]<stage>[#<rank>]:<step>[:<run_id pattern>] with action "
    f"one of {', '.join(ACTIONS)}, e.g. update_actor:2, kill@generate_g0:2 or "
    "hang-always@reward_g0:1:nightly-*"
)


@dataclass(frozen=True)
class FaultSpec:
    """One item of `DAPO_FAULT`."""

    action: str
    """fail | kill | kill-always | hang | hang-always."""
    stage: str
    """The run-store stage name it applies to."""
    step: int
    """The train step it applies to."""
    rank: int = 0
    """The data-parallel rank or replica index that acts (worker actions)."""
    run_pattern: str | None = None
    """Shell-style pattern of the run ids it applies to (None: every run)."""

    @property
    def once(self) -> bool:
        """A worker action that acts once per run (recorded by a marker file), not on every attempt."""
        return self.action in ("kill", "hang")

    @property
    def in_worker(self) -> bool:
        """Whether the worker process acts (kill, hang) rather than the driver (fail)."""
        return self.action != "fail"

    def matches(self, stage: str, step: int, run_id: str, rank: int = 0) -> bool:
        """Whether this item applies to (stage, step) of run `run_id` on rank `rank`."""
        return (
            self.stage == stage
            and self.step == step
            and (not self.in_worker or self.rank == rank)
            and (self.run_pattern is None or fnmatch(run_id, self.run_pattern))
        )

    def marker(self, root: str | Path) -> Path:
        """The file that records that this once-only item acted in the run folder `root`."""
        name = f"{self.action}@{self.stage}#{self.rank}:{self.step}"
        return Path(root) / MARKER_DIR / f"{name}.done"

    def __str__(self) -> str:
        rank = f"#{self.rank}" if self.in_worker and self.rank else ""
        run = f":{self.run_pattern}" if self.run_pattern else ""
        return f"{self.action}@{self.stage}{rank}:{self.step}{run}"


def parse_faults(spec: str) -> list[FaultSpec]:
    """The items of a `DAPO_FAULT` value (empty for ""); a ValueError naming the variable and the grammar for
    an item that does not parse."""
    out = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        m = _ITEM.match(item)
        action = (m.group("action") or "fail") if m else ""
        if m is None or action not in ACTIONS or (action == "fail" and m.group("rank")):
            raise ValueError(f"{FAULT_ENV}={spec!r}: cannot read {item!r}; {_GRAMMAR} — or unset it")
        out.append(
            FaultSpec(
                action=action,
                stage=m.group("stage"),
                step=int(m.group("step")),
                rank=int(m.group("rank") or 0),
                run_pattern=m.group("run"),
            )
        )
    return out


def faults_from_env() -> list[FaultSpec]:
    """The items of `DAPO_FAULT` in this process's environment (empty when unset)."""
    return parse_faults(os.environ.get(FAULT_ENV, ""))


def fault_point(root: str, stage: str, step: int) -> None:
    """The worker-side hook, called as a worker starts computing (step, stage) of the run folder `root`: kill
    or hang this process when `DAPO_FAULT` says so (nothing otherwise; a kill only in a Ray worker). A
    replica's share (`<stage>_r<i>of<M>`) is its stage on rank i; in a data-parallel group the rank is the
    process's."""
    if not os.environ.get(FAULT_ENV):
        return
    in_ray_worker = _in_ray_worker()
    rank = _rank()
    share = _SHARE.match(stage)
    if share is not None:
        stage, rank = share.group("stage"), int(share.group("index"))
    run_id = Path(root).name
    for fault in faults_from_env():
        if not fault.in_worker or not fault.matches(stage, step, run_id, rank):
            continue
        if fault.action.startswith("kill") and not in_ray_worker:
            continue
        if fault.once:
            marker = fault.marker(root)
            if marker.exists():
                continue
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"pid {os.getpid()} at {time.time():.3f}\n")
        print(f"{FAULT_ENV}: {fault} acts in pid {os.getpid()}", file=sys.stderr, flush=True)
        if fault.action.startswith("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: a stage that never returns
            time.sleep(3600)


def _in_ray_worker() -> bool:
    """Whether this process is a Ray actor (not the driver, not an in-process worker)."""
    if "ray" not in sys.modules:
        return False
    import ray

    return bool(ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None)


def _rank() -> int:
    """This process's data-parallel rank (0 for a single worker)."""
    from dapo_core.compute import dist

    dp = dist.current()
    return dp.rank if dp is not None else 0
