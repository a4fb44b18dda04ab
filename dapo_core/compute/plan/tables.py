"""The plan's tables: a `Row` (bytes and the formula that gives them), a `RolePlan` (one role's rows, its
budget and verdict; also a shared GPU or a node's host RAM), its peak and its rendering."""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_core.compute.plan.shape import _gib


@dataclass
class Row:
    """One line of a role's table: a name, its bytes and the formula that gives them."""

    name: str
    bytes: int
    formula: str
    phase: str = ""
    """"" = held throughout; otherwise the pass it belongs to (the role's peak is the largest pass). The
    pass "load" (weights arriving, before anything else is allocated) stands alone."""


def _peak(rows: list[Row]) -> int:
    phases: dict[str, int] = {}
    for r in rows:
        if r.phase:
            phases[r.phase] = phases.get(r.phase, 0) + r.bytes
    held = sum(r.bytes for r in rows if not r.phase)
    load = phases.pop("load", 0)
    return max(held + max(phases.values(), default=0), load)


@dataclass
class RolePlan:
    """The estimate of one role on one GPU (on CPU: one process's resident memory), or of a shared GPU, or
    of a node's host RAM."""

    role: str
    rows: list[Row] = field(default_factory=list)
    knobs: list[str] = field(default_factory=list)
    """Config changes (dotted overrides) that each make this check pass; filled by `advise`."""
    budget: int | None = None
    """The memory this role may use (vLLM: gpu_memory_utilization × GPU), when known."""
    host_rows: list[Row] = field(default_factory=list)
    """Host RAM of one process of this role (GPU runs; on CPU the rows are the host RAM)."""
    procs_per_node: int = 1
    """Processes of this role on a node (ranks, or tensor-parallel workers)."""
    note: str = ""
    """A line printed under the role (what the numbers mean beyond the rows)."""
    beside: list[Row] = field(default_factory=list)
    """Device rows outside `budget` (vLLM on GPU: the push's buffers, which torch allocates beside vLLM's
    reservation); counted on the shared GPU."""

    @property
    def total(self) -> int:
        """Rows held throughout plus the largest pass; a "load" pass alone when it is larger."""
        return _peak(self.rows)

    @property
    def host_total(self) -> int:
        """Peak host RAM of one process of this role."""
        return _peak(self.host_rows)

    def fits(self) -> bool | None:
        """True/False against `budget`, None when no budget is known."""
        return None if self.budget is None else self.total <= self.budget


def _render_role(role: RolePlan, where: str) -> list[str]:
    width = max((len(r.name) + len(r.phase) + 2 for r in [*role.rows, *role.beside]), default=10)
    out = [f"[{role.role}]" + (f" ({where})" if where else "")]
    for r in role.rows:
        name = f"{r.phase}: {r.name}" if r.phase else r.name
        out.append(f"  {name:<{width}} {_gib(r.bytes):>11}   = {r.formula}")
    verdict = {None: "", True: "  fits", False: "  DOES NOT FIT"}[role.fits()]
    budget = f" of {_gib(role.budget)}" if role.budget is not None else ""
    how = " (held throughout + the largest pass)" if any(r.phase for r in role.rows) else ""
    out.append(f"  {'total':<{width}} {_gib(role.total):>11}{budget}{verdict}{how}")
    if role.beside:
        out.append("  beside its reservation, on the same GPU:")
        for r in role.beside:
            name = f"{r.phase}: {r.name}" if r.phase else r.name
            out.append(f"    {name:<{width - 2}} {_gib(r.bytes):>11}   = {r.formula}")
    if role.host_rows:
        out.append(f"  host RAM of each of its {role.procs_per_node} process(es) on a node:")
        for r in role.host_rows:
            name = f"{r.phase}: {r.name}" if r.phase else r.name
            out.append(f"    {name:<{width - 2}} {_gib(r.bytes):>11}   = {r.formula}")
        out.append(f"    {'peak':<{width - 2}} {_gib(role.host_total):>11}")
    if role.note:
        out.append(f"  note: {role.note}")
    if role.fits() is False:
        out.append(
            "  turn: " + ("; or ".join(role.knobs) if role.knobs else "no single setting fits (see below)")
        )
    out.append("")
    return out


def _largest(role: RolePlan, k: int = 3) -> str:
    """The `k` largest rows of a table, for saying what does not fit."""
    rows = sorted(role.rows, key=lambda r: -r.bytes)[:k]
    return "largest: " + ", ".join(
        f"{(r.phase + ': ') if r.phase else ''}{r.name} {_gib(r.bytes)}" for r in rows
    )
