"""What `dapo plan` and `dapo train` run: the GPU and host budgets (`gpu_budget`, `host_memory`), the checks
that refuse a run (`gpu_budget_problem`, `host_ram_problem`), `advise` (the config changes that fit, found by
re-planning: plan_advice.py) and `run_plan`, which prints the plan and returns the exit status."""

from __future__ import annotations

from typing import Any

from dapo_core.compute.plan.layout import _plan_device
from dapo_core.compute.plan.roles import make_plan
from dapo_core.compute.plan.shape import PlanError, _gib, parse_bytes
from dapo_core.compute.plan.tables import _largest
from dapo_core.compute.plan_advice import search


def gpu_budget(gpu_mem: str | None) -> tuple[int | None, str]:
    """The per-GPU memory to check against: `--gpu-mem`, else the first visible CUDA device, else None."""
    if gpu_mem:
        return parse_bytes(gpu_mem), f"--gpu-mem {gpu_mem}"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"CUDA device 0 ({props.name})"
    return None, "no GPU budget known"


def host_memory(field_name: str = "MemTotal") -> int | None:
    """This machine's RAM (`MemTotal`, or `MemAvailable`) from /proc/meminfo; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_budget_problem(cfg: Any, gpu_mem: str | None) -> str | None:
    """For `dapo train`: one paragraph when `cfg` runs on GPUs but their memory is unknown (no `--gpu-mem`, no
    CUDA device visible to the driver), else None. A plan with no budget checks nothing, so the run is refused
    rather than guessed."""
    if gpu_mem or str(cfg.trainer.device) != "cuda":
        return None
    budget, _ = gpu_budget(None)
    if budget is not None:
        return None
    return (
        "dapo train: trainer.device=cuda but this machine sees no GPU, so the memory plan has no per-GPU "
        "budget and cannot tell whether the run fits. Pass the memory of one GPU of the cluster, e.g. "
        "`dapo train --gpu-mem 80GiB ...` (`dapo plan --gpu-mem 80GiB ...` shows the plan first)."
    )


def advise(
    cfg: Any,
    check: str,
    *,
    gpu_mem: int | None,
    host_mem: int | None,
    model_config: str | None = None,
    dp: int = 1,
) -> list[str]:
    """Config changes (dotted overrides, space-separated) that make the failing `check` (a role, the shared
    GPU or a host) fit; each one verified by re-planning (plan_advice.py)."""
    return search(
        cfg,
        check,
        lambda c: make_plan(c, gpu_mem=gpu_mem, model_config=model_config, dp=dp, host_mem=host_mem),
    )


def host_ram_problem(
    cfg: Any, available: int | None = None, *, model_config: str | None = None
) -> str | None:
    """For a CPU run's preflight: one paragraph when the plan's host RAM of this node (every process's peak,
    Ray, the driver) exceeds `available` bytes (default: /proc/meminfo MemAvailable), with the config changes
    that make it fit; None when it fits, the run is on GPUs, or no plan can be made."""
    if _plan_device(cfg) != "cpu":
        return None
    available = available if available is not None else host_memory("MemAvailable")
    try:
        plan = make_plan(cfg, model_config=model_config, host_mem=available)
    except PlanError:
        return None
    node = plan.hosts[0]
    if node.fits() is not False:
        return None
    knobs = advise(cfg, node.role, gpu_mem=None, host_mem=available, model_config=model_config)
    fix = "; or ".join(knobs) if knobs else f"a machine with more memory ({_largest(node)})"
    return (
        f"The run's processes need about {_gib(node.total)} of RAM on this machine (memory plan: "
        f"{', '.join(f'{r.name} {_gib(r.bytes)}' for r in node.rows)}) but {_gib(available)} is available. "
        f"Change: {fix} (`dapo plan --config ...` shows every row)."
    )


EXIT_UNKNOWN_BUDGET = 3
"""`dapo plan`'s exit status when a GPU config's per-GPU memory is unknown: the plan is printed, nothing is
checked (0 = it fits, 2 = it does not fit or cannot be made)."""


def run_plan(
    cfg: Any,
    command: str,
    *,
    gpu_mem: str | None = None,
    model_config: str | None = None,
    dp: int = 1,
    out: Any = None,
    host_mem: str | None = None,
) -> int:
    """Print the plan of `cfg`; return 0 when it fits, 2 when a check fails (with the changes that fix it),
    `EXIT_UNKNOWN_BUDGET` for `dapo plan` on a GPU config without a GPU budget.

    `command` is "plan" or "train": for `dapo train` a plan that cannot be made (no model shape known) is a
    note, not an error, and a GPU config without a known GPU budget is refused (`gpu_budget_problem`).
    """
    import sys

    out = out or sys.stdout
    try:
        device = _plan_device(cfg)
        budget, where = gpu_budget(gpu_mem)
        if device == "cpu":
            budget, where = None, "trainer.device=cpu: memory of each process (host RAM)"
        here = device == "cpu" or (
            gpu_mem is None and budget is not None
        )  # this machine is a node of the run
        hmem = parse_bytes(host_mem) if host_mem else (host_memory() if here else None)
        plan = make_plan(cfg, gpu_mem=budget, model_config=model_config, dp=dp, host_mem=hmem)
    except PlanError as e:
        if command == "train":
            print(f"dapo train: note: no memory plan ({e})", file=sys.stderr)
            return 0
        print(f"dapo {command}: {e}", file=sys.stderr)
        return 2
    print(f"dapo {command}: memory plan ({where})", file=out)
    failures = plan.failures()
    for check in failures:
        check.knobs = advise(cfg, check.role, gpu_mem=budget, host_mem=hmem, model_config=model_config, dp=dp)
    print(plan.render(), file=out, flush=True)
    if device == "cuda" and budget is None:
        if command == "train":
            print(gpu_budget_problem(cfg, None) or "", file=sys.stderr, flush=True)
            return 2
        print(
            f"dapo plan: unknown budget: no --gpu-mem and no GPU here, so nothing was checked (exit "
            f"{EXIT_UNKNOWN_BUDGET}); pass --gpu-mem, e.g. 80GiB.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_UNKNOWN_BUDGET
    if not failures:
        return 0
    lines = [
        f"dapo {command}: {r.role} needs {_gib(r.total)} but has {_gib(r.budget)}; change: "
        + (
            "; or ".join(r.knobs)
            if r.knobs
            else f"no setting of the memory keys fits ({_largest(r)}); more or larger GPUs/RAM"
        )
        + "."
        for r in failures
    ]
    if command == "train":
        lines.append("dapo train: refusing to start a run that cannot fit (see the plan above).")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 2
