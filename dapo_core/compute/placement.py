"""Where a worker may run: the custom Ray resources of `trainer.ray_resources.<role>`, checked before
anything is started.

`checked_resources` validates a role's request (a `PlacementError` names the key and the fix);
`check_feasible` refuses a request that no live node of the cluster can satisfy (Ray would keep such an
actor pending forever).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dapo_core.errors import DapoUserError

RESOURCES_KEY = "trainer.ray_resources"
"""The config section that places each role's worker on nodes with Ray custom resources."""


class PlacementError(DapoUserError):
    """A worker's placement (`trainer.ray_resources.<role>`) is malformed or no node of the cluster can
    satisfy it."""


def checked_resources(role: str, resources: Mapping[str, Any] | None) -> dict[str, float]:
    """`resources` of worker `role` as {name: amount}, or a `PlacementError` naming the key and the fix.

    Amounts are finite numbers > 0; above 1 they must be whole (Ray's rule for resource quantities). The
    names CPU, GPU and memory are Ray's built-in resources and are set by the device, not here."""
    key = f"{RESOURCES_KEY}.{role}"
    out: dict[str, float] = {}
    for name, amount in (resources or {}).items():
        name = str(name)
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise PlacementError(
                f"{key} asks for the built-in Ray resource {name!r}",
                where=key,
                fix=(
                    "name a custom resource that the node advertises (ray start --resources "
                    "'{\"gen_node\": 1}'); CPUs and GPUs per worker follow trainer.device"
                ),
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not math.isfinite(amount):
            bad = f"{amount!r} is not a number"
        elif amount <= 0:
            bad = f"{amount!r} is not > 0"
        elif amount > 1 and amount != int(amount):
            bad = f"{amount!r} is above 1 and not a whole number (Ray's rule for resource amounts)"
        else:
            out[name] = float(amount)
            continue
        raise PlacementError(
            f"{key}.{name}: {bad}",
            where=key,
            fix=f"give the amount of resource {name!r} the {role} worker takes, e.g. {key}={{{name}: 1}}",
        )
    return out


def _node_summary(node: Mapping[str, Any]) -> str:
    """'192.0.2.2 (node 1a2b3c4d): CPU 2, gen_node 1' for an entry of `ray.nodes()`."""
    res = {
        k: v
        for k, v in node.get("Resources", {}).items()
        if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }
    listed = ", ".join(f"{k} {v:g}" for k, v in sorted(res.items())) or "no resources"
    return f"{node.get('NodeManagerAddress', '?')} (node {str(node.get('NodeID', '?'))[:8]}): {listed}"


def check_feasible(role: str, request: Mapping[str, float], nodes: list[Mapping[str, Any]]) -> None:
    """Raise `PlacementError` unless one live node of `nodes` (`ray.nodes()`) offers every resource of
    `request` in at least the asked amount. An infeasible actor would otherwise wait forever (Ray keeps it
    pending until such a node joins)."""
    alive = [n for n in nodes if n.get("Alive", True)]
    if any(all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in request.items()) for n in alive):
        return
    custom = {k: v for k, v in request.items() if k not in ("CPU", "GPU")}
    asked = ", ".join(f"{k}={v:g}" for k, v in request.items())
    have = "; ".join(_node_summary(n) for n in alive) or "no live node"
    missing = [k for k in custom if not any(k in n.get("Resources", {}) for n in alive)]
    why = (
        f"no node of the cluster offers resource(s) {', '.join(repr(k) for k in missing)}"
        if missing
        else "no single node offers all of them in that amount"
    )
    raise PlacementError(
        f"worker '{role}' asks for {asked} ({RESOURCES_KEY}.{role}: {dict(custom) or '{}'}), but {why}; the "
        f"cluster's nodes: {have}",
        where=f"{RESOURCES_KEY}.{role}",
        fix=(
            f"start (or wait for) a node that offers them, e.g. infra/ray_cluster.sh join HEAD:PORT "
            f"--resources '{{\"{next(iter(custom), 'gen_node')}\": 1}}' (`ray status` lists what the "
            f"cluster has), or change {RESOURCES_KEY}.{role} (empty = any node)"
        ),
    )
