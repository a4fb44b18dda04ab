"""Peak resident memory of the worker processes, next to `dapo plan`'s estimate of the same processes.

Every Ray worker answers `memory()` with its resident high-water mark (`VmHWM` in /proc/self/status: the
largest resident set the process ever had), its resident size now (`VmRSS`) and the CPU seconds it used. At
the end of a run the driver collects them (`Cluster.memory_report`) and `compare_to_plan` lines each process
up with its role's plan: on CPU the role's total (its rows are the process's resident memory), on GPU the
role's host rows. The result is written to `runs/<id>/memory.json` and printed as one line per role, so every
run checks the plan against what it actually used.
"""

from __future__ import annotations

import resource
from typing import Any

__all__ = ["compare_to_plan", "process_memory", "rss_bytes"]


def rss_bytes(key: str = "VmRSS") -> int:
    """A memory figure of this process from /proc/self/status, in bytes (`VmRSS` now, `VmHWM` peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def process_memory() -> dict[str, Any]:
    """This process's resident memory, `peak_rss_bytes` (VmHWM) and `rss_bytes` (VmRSS), and the CPU time
    its threads used so far, `cpu_s` (user + system; over a wall span it is the cores the process kept
    busy)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "peak_rss_bytes": rss_bytes("VmHWM"),
        "rss_bytes": rss_bytes("VmRSS"),
        "cpu_s": round(use.ru_utime + use.ru_stime, 3),
    }


def compare_to_plan(measured: list[dict[str, Any]], plan: Any, device: str) -> dict[str, Any]:
    """Line up each measured process (`{"role", "rank", "peak_rss_bytes", ...}`) with its role's plan.

    Returns `{"processes": [... + "plan_bytes", "measured_over_plan"], "roles": {role: {"peak_rss_bytes"
    (largest over its processes), "plan_bytes", "measured_over_plan"}}}`; roles the plan has no row for
    (the reward worker, for one) carry `plan_bytes: None`. `plan` is a `MemoryPlan`; on CPU a role's plan
    is its `total`, on GPU its `host_total` (the resident memory of one of its processes).
    """
    planned = {r.role: (r.total if device == "cpu" else r.host_total) for r in plan.roles}
    processes = []
    roles: dict[str, dict[str, Any]] = {}
    for m in measured:
        want = planned.get(m["role"]) or None
        peak = int(m["peak_rss_bytes"])
        processes.append({**m, "plan_bytes": want, "measured_over_plan": _ratio(peak, want)})
        cur = roles.setdefault(m["role"], {"peak_rss_bytes": 0, "plan_bytes": want})
        cur["peak_rss_bytes"] = max(cur["peak_rss_bytes"], peak)
    for r in roles.values():
        r["measured_over_plan"] = _ratio(r["peak_rss_bytes"], r["plan_bytes"])
    return {"device": device, "processes": processes, "roles": roles}


def _ratio(a: int, b: int | None) -> float | None:
    return None if not b else round(a / b, 3)
