"""`dapo plan`: the memory of every role per GPU and per host, each row with the formula that gives it.

The layout is the config's: `trainer.nnodes × n_gpus_per_node` GPUs (processes on CPU). An FSDP actor
(`strategy: fsdp2`) shards weights, gradients and AdamW state over that whole world and shares every GPU with
a rollout replica of `tensor_model_parallel_size` GPUs (replicas = world // tp), as verl's hybrid engine does;
the torch and DeepSpeed engines run one process per role, each on a GPU of its own. `make_plan` returns the
per-role rows (what a process holds on its device: on CPU that is the process's resident memory), the sum for
a GPU shared by several roles, and the host RAM of each node. A role's peak is what it holds throughout plus
its largest pass; a "load" pass (weights arriving) stands alone. The weight push after each update is a
"sync" pass of its own (one tensor in flight and the buckets of `weight_transport`, never the whole model),
and `MemoryPlan.sync` gives its bytes and estimated seconds per step at assumed bandwidths (constants of
sync.py). `advise` (plan_advice.py) finds the config changes that make a failing check pass by
re-planning with each. `gpu_budget_problem` is the check that makes `dapo train` refuse a GPU config whose
per-GPU memory it does not know. Checked against measured peaks in tests/unit/dapo_core/compute/test_plan.py
(with a real push of a tiny model over `weight_transport`), bench/bench_plan.py (CPU) and
bench/gpu_memory_check.sh (GPU); the measurements are `tests.helpers.measure_actor_update` and
`measure_rollout`.

Modules, each importing only those above it: shape.py (the model's sizes, byte sizes), tables.py (rows and
role tables), layout.py (where the roles run), formulas.py (a pass's activations and logits), states.py
(weights, gradients, optimizer of a rank), sync.py (the weight push), roles.py (every role's table and
`make_plan`), cli.py (`run_plan`, budgets, `advise`).
"""

from __future__ import annotations

from dapo_core.compute.plan.cli import (
    EXIT_UNKNOWN_BUDGET,
    advise,
    gpu_budget,
    gpu_budget_problem,
    host_memory,
    host_ram_problem,
    run_plan,
)
from dapo_core.compute.plan.formulas import activation_bytes
from dapo_core.compute.plan.layout import Layout, resolve_layout
from dapo_core.compute.plan.roles import DRIVER_BYTES, RAY_NODE_BYTES, MemoryPlan, make_plan
from dapo_core.compute.plan.shape import BUILTIN_SHAPES, ModelShape, PlanError, parse_bytes, resolve_shape
from dapo_core.compute.plan.states import NCCL_BUFFER_BYTES, PROCESS_BYTES
from dapo_core.compute.plan.sync import SyncPlan
from dapo_core.compute.plan.tables import RolePlan

__all__ = [
    "BUILTIN_SHAPES",
    "DRIVER_BYTES",
    "EXIT_UNKNOWN_BUDGET",
    "NCCL_BUFFER_BYTES",
    "PROCESS_BYTES",
    "RAY_NODE_BYTES",
    "Layout",
    "MemoryPlan",
    "ModelShape",
    "PlanError",
    "RolePlan",
    "SyncPlan",
    "activation_bytes",
    "advise",
    "gpu_budget",
    "gpu_budget_problem",
    "host_memory",
    "host_ram_problem",
    "make_plan",
    "parse_bytes",
    "resolve_layout",
    "resolve_shape",
    "run_plan",
]
