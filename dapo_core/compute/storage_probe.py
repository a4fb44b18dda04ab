"""Shared storage, checked before any worker starts: every live Ray node proves it sees the driver's run
folder and can read the model and data.

The driver writes `.probe-<nonce>` into the run folder; on each node a zero-CPU Ray task pinned there reads it
back (the nonce must match), writes `.probe-<nonce>-<node id>` beside it and reads each input path (a file's
first byte, a folder's listing); the driver then reads every reply. A node whose reply the driver cannot read
wrote into a folder of its own at the same path, not the shared one. The driver's own node runs the same
check in the driver's process (no task). Any failure is one `DapoUserError` naming the node (id and IP), the
path and the fix; the probe files are removed either way.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapo_core.errors import DapoUserError

__all__ = ["StorageError", "probe_storage"]

PROBE_TIMEOUT_S = 120.0
"""How long a node may take to answer (its first task may start a worker process and its runtime env)."""

FIX = (
    "mount the shared filesystem (NFS, Lustre, CephFS, GPFS) at the same path on every node, or point "
    "trainer.runs_dir, trainer.models_dir / actor_rollout_ref.model.path and data.train_files / "
    "data.val_files at paths on it"
)


class StorageError(DapoUserError, OSError):
    """A node cannot read or write the run folder, or read an input, at the driver's paths."""


def _check_node(run_dir: str, nonce: str, node_id: str, read_paths: Sequence[str]) -> str | None:
    """On one node: read the driver's probe, write this node's reply, read every input. Returns None, or what
    failed (`<path>: <reason>`)."""
    probe = os.path.join(run_dir, f".probe-{nonce}")
    try:
        with open(probe) as f:
            got = f.read()
    except OSError as e:
        return f"cannot read the run folder's probe file {probe} ({e.strerror or e})"
    if got != nonce:
        return f"reads a different {probe} than the driver wrote (a folder of its own at the same path)"
    reply = os.path.join(run_dir, f".probe-{nonce}-{node_id}")
    try:
        fd = os.open(reply, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, f"{nonce} {node_id}".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return f"cannot write into the run folder {run_dir} ({e.strerror or e})"
    for path in read_paths:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(1)
        except OSError as e:
            return f"cannot read {path} ({e.strerror or e})"
    return None


def _remote_check(run_dir: str, nonce: str, read_paths: Sequence[str]) -> tuple[str, str | None]:
    """`_check_node` on the node this task runs on: (node id, result)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return node_id, _check_node(run_dir, nonce, node_id, read_paths)


def _refuse(node: dict[str, Any], problem: str) -> StorageError:
    return StorageError(
        f"Ray node {node['NodeID']} ({node.get('NodeManagerAddress', '?')}) {problem}: every node must see "
        f"the run folder, the model and the data at the driver's paths before any model loads",
        fix=FIX,
    )


def probe_storage(
    run_dir: Path, read_paths: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S
) -> dict[str, float]:
    """Check every live node of the connected Ray cluster against the run folder `run_dir` (which exists) and
    the input paths `read_paths` (those that exist here; others, e.g. hub names, are skipped). Returns the
    seconds each node took (by node id); raises `StorageError` for the first node that fails or does not
    answer within `timeout_s`."""
    import time

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    t0 = time.perf_counter()
    paths = [str(Path(p).resolve()) for p in read_paths if p and os.path.exists(p)]
    run = str(Path(run_dir).resolve())
    nonce = secrets.token_hex(8)
    probe = Path(run) / f".probe-{nonce}"
    probe.write_text(nonce)
    nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    here = ray.get_runtime_context().get_node_id()
    took: dict[str, float] = {}
    try:
        remote = ray.remote(num_cpus=0, max_retries=0)(_remote_check)
        pending = {
            remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
                run, nonce, paths
            ): node_id
            for node_id in nodes
            if node_id != here
        }
        if here in nodes:  # the driver's node: the same check, in this process
            problem = _check_node(run, nonce, here, paths)
            if problem:
                raise _refuse(nodes[here], problem)
            _confirm_reply(probe, nonce, nodes[here])
            took[here] = time.perf_counter() - t0
        deadline = time.monotonic() + timeout_s
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                node = nodes[pending[next(iter(pending))]]
                for ref in pending:
                    ray.cancel(ref, force=True)
                raise _refuse(node, f"did not answer the storage probe within {timeout_s:.0f} s")
            ref = done[0]
            node_id = pending.pop(ref)
            try:
                _, problem = ray.get(ref)
            except Exception as e:  # the node died, or its worker could not start (e.g. its runtime env)
                raise _refuse(nodes[node_id], f"could not run the storage probe ({type(e).__name__})") from e
            if problem:
                raise _refuse(nodes[node_id], problem)
            _confirm_reply(probe, nonce, nodes[node_id])
            took[node_id] = time.perf_counter() - t0
    finally:
        for f in Path(run).glob(f".probe-{nonce}*"):
            f.unlink(missing_ok=True)
    return took


def _confirm_reply(probe: Path, nonce: str, node: dict[str, Any]) -> None:
    """The driver reads the node's reply: it must be there with the node's words."""
    reply = probe.with_name(f"{probe.name}-{node['NodeID']}")
    try:
        got = reply.read_text()
    except OSError:
        got = ""
    if got != f"{nonce} {node['NodeID']}":
        raise _refuse(
            node,
            f"wrote its reply into {probe.parent}, but the driver does not see it there (the node writes "
            f"to a folder of its own at the same path)",
        )
