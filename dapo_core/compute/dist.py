"""Data parallelism inside one worker process: the process-group seam, the row split, and small collectives.

`init_data_parallel` is the one place a process group is made: gloo on CPU, NCCL on CUDA (each rank's Ray
actor sees one GPU as device 0; the rendezvous is rank 0's node address and the port its `listen_store`
already listens on). Every other helper takes a `DataParallel` (rank, size, and a gloo group for host-side
collectives, which NCCL cannot run), or None for a single process. `dp_split` divides a batch's rows among the
ranks by token count, whole groups (e.g. a prompt's `uid`) together; every rank computes the same split from
the same table, so no row list travels. `gather_table` brings each rank's output rows to rank 0 as Arrow IPC
bytes in uint8 tensors (no pickle).
"""

from __future__ import annotations

import datetime
import io
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

__all__ = [
    "DataParallel",
    "dp_split",
    "free_port",
    "gather_table",
    "init_data_parallel",
    "listen_store",
    "node_address",
]

TIMEOUT = datetime.timedelta(minutes=30)
"""How long a collective waits for the other ranks before it fails (a dead rank surfaces as an error)."""


def node_address() -> str:
    """The address other nodes reach this one at (Ray's view of this node; 127.0.0.1 for a loopback Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover - ray is a hard dependency
        pass
    return "127.0.0.1"


def free_port(host: str = "") -> int:
    """A TCP port free on this node now (the rendezvous port rank 0 announces)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class DataParallel:
    """This process's place in its role's data-parallel group."""

    rank: int
    size: int
    cpu_group: Any = None
    """A gloo group over the same ranks for host-side collectives (the default group itself on CPU)."""

    def max_int(self, value: int) -> int:
        """The largest `value` over the ranks."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return int(t.item())

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over the ranks (every rank must pass the same keys)."""
        keys = sorted(metrics)
        t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.cpu_group)
        return {k: float(v) / self.size for k, v in zip(keys, t.tolist(), strict=True)}


def listen_store(address: str) -> dist.TCPStore:
    """Rank 0's rendezvous store at `address` (this node's), already listening on a port the OS picked (its
    `port`): no other process can take that port between the moment rank 0 names it and the moment the
    ranks join, as one can with a port that was free when asked (`free_port`)."""
    return dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def init_data_parallel(
    rank: int, size: int, address: str, port: int, device: str, store: Any = None
) -> DataParallel:
    """Join the role's process group (the seam: gloo on CPU, NCCL on CUDA) and return this rank's
    `DataParallel`. The rendezvous is `store` when given (rank 0's `listen_store`), else a client of the
    store at `address:port`, or for rank 0 without one a store it starts there. On CUDA the actor's one
    visible GPU becomes the current device first; the NCCL group carries the gradients and weights, a
    second gloo group the host-side collectives."""
    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    if store is None:
        store = dist.TCPStore(address, port, is_master=rank == 0, wait_for_workers=False, timeout=TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else None
    return DataParallel(rank=rank, size=size, cpu_group=cpu_group)


def current() -> DataParallel | None:
    """This process's `DataParallel` when a process group is up, else None (a single process)."""
    return _CURRENT


_CURRENT: DataParallel | None = None


def set_current(dp: DataParallel | None) -> None:
    """Record the process's `DataParallel` (done once, by the rank host after `init_data_parallel`)."""
    global _CURRENT
    _CURRENT = dp


def dp_split(costs: Sequence[int], size: int, groups: Sequence[Any] | None = None) -> list[list[int]]:
    """Row indices for each of `size` ranks, balanced by the summed `costs` (tokens per row): whole groups
    (rows with the same `groups` value) are dealt, largest first, to the rank with the least load so far
    (ties: the lower rank); each rank's rows stay in their input order. Deterministic."""
    units: dict[Any, list[int]] = {}
    for i in range(len(costs)):
        units.setdefault(groups[i] if groups is not None else i, []).append(i)
    order = sorted(units.values(), key=lambda rows: (-sum(int(costs[r]) for r in rows), rows[0]))
    load = [0] * size
    parts: list[list[int]] = [[] for _ in range(size)]
    for rows in order:
        k = min(range(size), key=lambda j: (load[j], j))
        parts[k].extend(rows)
        load[k] += sum(int(costs[r]) for r in rows)
    return [sorted(p) for p in parts]


def _table_bytes(table: pa.Table) -> torch.Tensor:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return torch.frombuffer(bytearray(sink.getvalue()), dtype=torch.uint8)


def gather_table(dp: DataParallel, part: pa.Table, parts: list[list[int]]) -> pa.Table | None:
    """On rank 0: every rank's `part` (rank k's rows are `parts[k]` of the input) as one table in input row
    order; None on the other ranks."""
    payload = _table_bytes(part)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dp.size)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=dp.cpu_group)
    width = max(int(s.item()) for s in sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(dp.size)] if dp.rank == 0 else None
    dist.gather(padded, bufs, dst=0, group=dp.cpu_group)
    if bufs is None:
        return None
    tables = [
        pa.ipc.open_stream(pa.BufferReader(bytes(b[: int(s.item())].numpy()))).read_all()
        for b, s in zip(bufs, sizes, strict=True)
    ]
    joined = pa.concat_tables(tables)
    order = [r for p in parts for r in p]
    restore = sorted(range(len(order)), key=order.__getitem__)
    return joined.take(pa.array(restore, type=pa.int64()))
