"""Weights on the move: the actor's tensors streamed to the rollout workers in buckets of a fixed size.

A push never holds the whole model anywhere. Each actor rank gathers one tensor at a time
(`TrainEngine.iter_sync_tensors`), casts it to the rollout dtype and copies it into a bucket of
`bucket_bytes`; a tensor larger than a bucket is split over several. A full bucket travels to the rollout
workers over a **link**, then its buffer is reused. No message (a bucket's payload, or the small JSON header
describing its pieces) is ever larger than the bucket, and both ends check it.

A link has one sender (an actor rank) and one or more receivers (rollout workers), and one of two kinds
behind one seam (`Sender` / `Receiver`):
- `same_device`: the sender and its one receiver share a device (colocated). The bucket lives in memory both
  map: a shared-memory segment on CPU, a CUDA IPC handle of a device buffer on GPU. Only the header crosses
  the control group.
- `broadcast`: a collective broadcast from the sender to every receiver of the link (gloo on CPU, NCCL on
  GPU), for rollout workers on other devices or nodes (the async order, disaggregated pools).
Each link's control group is a process group of its own (a gloo `ProcessGroup` over a `TCPStore` that the
first receiver hosts), separate from the actor's data-parallel group, so actor ranks and rollout workers
in different Ray actors can join it; the headers (and, for `broadcast`, the payloads) travel over it.

The receiver reassembles each tensor from its pieces and hands it to the engine's loader one tensor at a
time; at the end the sender's manifest (every name it sent, and the names that alias another tensor) is
checked against what arrived, so a push either delivers the whole set or fails.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "KINDS",
    "Link",
    "Piece",
    "PushStats",
    "Receiver",
    "Sender",
    "TransportError",
    "bucketed",
    "distinct_tensors",
    "plan_links",
    "receive_into",
    "send_all",
]

KINDS = ("same_device", "broadcast")
TIMEOUT = datetime.timedelta(minutes=10)
"""How long a link waits for its other end (a dead peer surfaces as an error, not a hang)."""
_ALIGN = 64
"""Pieces start at multiples of this many bytes inside a bucket (aligned views for every dtype)."""


class TransportError(RuntimeError):
    """A push broke its contract: a message larger than the bucket, or a set of tensors that did not arrive
    whole."""


@dataclass(frozen=True)
class Link:
    """One sender and its receivers, as the driver plans them (small and JSON-able: it travels in calls)."""

    kind: str
    """`same_device` or `broadcast`."""
    source_rank: int
    """The actor rank that sends."""
    receivers: int
    """How many rollout workers receive (1 for `same_device`)."""
    host: str
    """Address of the control group's store (the first receiver's node)."""
    port: int
    """Its port."""
    bucket_bytes: int
    """The largest message, in bytes."""
    dtype: str
    """The dtype tensors travel in (the rollout's), e.g. `bfloat16`."""
    device: str = "cpu"
    """`cpu` or `cuda`: where the bucket lives (and NCCL instead of gloo for `broadcast` payloads)."""
    tag: str = "push"
    """A name unique to this push, prefixing the store's keys (and the shared-memory segment)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"link kind {self.kind!r}: expected one of {KINDS}")
        if self.kind == "same_device" and self.receivers != 1:
            raise ValueError("a same_device link has exactly one receiver")
        if self.bucket_bytes < _ALIGN:
            raise ValueError(f"bucket_bytes {self.bucket_bytes} is below the {_ALIGN}-byte minimum")


@dataclass(frozen=True)
class Piece:
    """A byte range of one tensor inside a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Offset of this range in the tensor's bytes."""
    length: int
    offset: int
    """Offset of this range in the bucket."""
    total: int
    """The tensor's size in bytes."""


@dataclass
class PushStats:
    """What one end of a link moved: tensor bytes, buckets, the largest message (payload or header) and
    seconds."""

    bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    max_message_bytes: int = 0
    seconds: float = 0.0

    def as_metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}buckets": float(self.buckets),
            f"{prefix}tensors": float(self.tensors),
            f"{prefix}max_message_bytes": float(self.max_message_bytes),
            f"{prefix}seconds": float(self.seconds),
        }


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def bucketed(
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[list[Piece], torch.Tensor]]:
    """Pack `named` tensors (floating-point ones cast to `dtype` when given) into buckets of at most
    `bucket_bytes`; yields (pieces, payload), where payload is a uint8 view of the one reused buffer,
    valid until the next item. A tensor larger than the space left is split over buckets; one that fits in
    a fresh bucket is not."""
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    pieces: list[Piece] = []
    used = 0
    for name, tensor in named:
        t = tensor.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        t = t.to(buffer.device).contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        total = raw.numel()
        if 0 < total <= bucket_bytes and _aligned(used) + total > bucket_bytes and pieces:
            yield pieces, buffer[:used]
            pieces, used = [], 0
        start = 0
        while True:
            at = _aligned(used)
            if at >= bucket_bytes and pieces:
                yield pieces, buffer[:used]
                pieces, used, at = [], 0, 0
            n = min(total - start, bucket_bytes - at)
            buffer[at : at + n].copy_(raw[start : start + n])
            pieces.append(Piece(name, _dtype_name(t.dtype), tuple(t.shape), start, n, at, total))
            used, start = at + n, start + n
            if start >= total:
                break
    if pieces:
        yield pieces, buffer[:used]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# -- the control group ---------------------------------------------------------------------------------------
class _Control:
    """A gloo process group over the link's members (rank 0 the sender, 1.. the receivers), made from a
    TCPStore that the first receiver hosts; headers are broadcast from the sender as length + JSON bytes."""

    def __init__(self, link: Link, rank: int) -> None:
        self.link = link
        size = 1 + link.receivers
        self.store: Any = dist.TCPStore(
            link.host, link.port, size, is_master=(rank == 1), timeout=TIMEOUT, wait_for_workers=True
        )
        prefix = dist.PrefixStore(f"{link.tag}/ctl", self.store)
        self.group: Any = dist.ProcessGroupGloo(prefix, rank, size, TIMEOUT)
        self.data: Any = self.group
        if link.kind == "broadcast" and link.device == "cuda":
            self.data = _nccl_group(dist.PrefixStore(f"{link.tag}/data", self.store), rank, size)

    def broadcast(self, tensor: torch.Tensor, group: Any = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        (group or self.group).broadcast([tensor], opts).wait()

    def send_header(self, header: dict[str, Any]) -> int:
        raw = json.dumps(header, separators=(",", ":")).encode()
        if len(raw) > self.link.bucket_bytes:
            raise TransportError(
                f"a header of {len(raw)} bytes exceeds the {self.link.bucket_bytes}-byte bucket; raise "
                "actor_rollout_ref.rollout.update_weights_bucket_megabytes"
            )
        self.broadcast(torch.tensor([len(raw)], dtype=torch.int64))
        self.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return len(raw)

    def recv_header(self) -> tuple[dict[str, Any], int]:
        n = torch.zeros(1, dtype=torch.int64)
        self.broadcast(n)
        size = int(n.item())
        if size > self.link.bucket_bytes:
            raise TransportError(f"a header of {size} bytes exceeds the {self.link.bucket_bytes}-byte bucket")
        raw = torch.empty(size, dtype=torch.uint8)
        self.broadcast(raw)
        return json.loads(raw.numpy().tobytes()), size

    def barrier(self) -> None:
        self.group.barrier().wait()

    def shutdown(self) -> None:
        """Drop the groups and the store: their connections close, so a peer still waiting in a collective
        fails at once instead of at the timeout."""
        self.group = self.data = None
        self.store = None


def _nccl_group(store: Any, rank: int, size: int) -> Any:  # pragma: no cover - needs CUDA
    opts = dist.ProcessGroupNCCL.Options()
    return dist.ProcessGroupNCCL(store, rank, size, opts)


# -- same-device buffers: shared memory on CPU, CUDA IPC on GPU ----------------------------------------------
class _SharedBuffer:
    """The sender's bucket in memory the receiver maps: a file in /dev/shm mapped shared (CPU) or a device
    buffer exported by CUDA IPC (GPU). `handle` is JSON-able; `_AttachedBuffer(handle)` maps it on the
    other side. The sender removes the file when the push ends."""

    def __init__(self, link: Link) -> None:
        self.path: Path | None = None
        if link.device == "cuda":  # pragma: no cover - needs CUDA
            self.tensor = torch.empty(link.bucket_bytes, dtype=torch.uint8, device="cuda")
            self.handle: dict[str, Any] = {"cuda": _cuda_ipc_handle(self.tensor)}
        else:
            self.path = _shm_dir() / f"dapo-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            with open(self.path, "wb") as f:
                f.truncate(link.bucket_bytes)
            self.tensor = torch.from_file(
                str(self.path), shared=True, size=link.bucket_bytes, dtype=torch.uint8
            )
            self.handle = {"file": str(self.path)}

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


class _AttachedBuffer:
    def __init__(self, handle: dict[str, Any], nbytes: int) -> None:
        if "cuda" in handle:  # pragma: no cover - needs CUDA
            self.tensor = _cuda_ipc_open(handle["cuda"], nbytes)
        else:
            self.tensor = torch.from_file(handle["file"], shared=True, size=nbytes, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor


def _shm_dir() -> Path:
    """Memory-backed files: /dev/shm where the OS has it, else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _cuda_ipc_handle(t: torch.Tensor) -> dict[str, Any]:  # pragma: no cover - needs CUDA
    """The JSON-able CUDA IPC handle of `t`'s storage (what torch.multiprocessing shares, without pickle)."""
    import base64

    storage = t.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, sync = storage._share_cuda_()
    b64 = base64.b64encode
    return {
        "device": int(device),
        "handle": b64(handle).decode(),
        "size": int(size),
        "offset": int(offset),
        "ref_handle": b64(ref_handle).decode(),
        "ref_offset": int(ref_offset),
        "event": b64(event).decode() if event else "",
        "sync": bool(sync),
    }


def _cuda_ipc_open(h: dict[str, Any], nbytes: int) -> torch.Tensor:  # pragma: no cover - needs CUDA
    import base64

    d = base64.b64decode
    storage = torch.UntypedStorage._new_shared_cuda(
        h["device"],
        d(h["handle"]),
        h["size"],
        h["offset"],
        d(h["ref_handle"]),
        h["ref_offset"],
        d(h["event"]) if h["event"] else b"",
        h["sync"],
    )
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{torch.cuda.current_device()}")
    t.set_(storage, 0, (nbytes,), (1,))
    return t


# -- the two ends --------------------------------------------------------------------------------------------
class Sender:
    """The actor rank's end of a link: `send(pieces, payload)` per bucket, then `finish(names, aliases)`."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.ctl = _Control(link, 0)
        self.shared = _SharedBuffer(link) if link.kind == "same_device" else None
        self.stats = PushStats()
        self._opened = False

    def send(self, pieces: list[Piece], payload: torch.Tensor) -> None:
        n = int(payload.numel())
        if n > self.link.bucket_bytes:
            raise TransportError(f"a bucket of {n} bytes exceeds its {self.link.bucket_bytes}-byte limit")
        header: dict[str, Any] = {"pieces": [asdict(p) for p in pieces], "nbytes": n}
        if self.shared is not None:
            if not self._opened:
                header["buffer"] = self.shared.handle
                self._opened = True
            self.shared.tensor[:n].copy_(payload)
            if self.link.device == "cuda":  # pragma: no cover - needs CUDA
                torch.cuda.current_stream().synchronize()
        hb = self.ctl.send_header(header)
        if self.shared is None:
            self.ctl.broadcast(payload if payload.is_contiguous() else payload.contiguous(), self.ctl.data)
        else:
            self.ctl.barrier()  # the receiver has copied the bucket out: the buffer may be refilled
        self.stats.bytes += sum(p.length for p in pieces)
        self.stats.buckets += 1
        self.stats.max_message_bytes = max(self.stats.max_message_bytes, n, hb)

    def finish(self, names: list[str], aliases: dict[str, str]) -> PushStats:
        hb = self.ctl.send_header({"end": True, "names": names, "aliases": aliases})
        self.stats.max_message_bytes = max(self.stats.max_message_bytes, hb)
        self.stats.tensors = len(names)
        self.ctl.barrier()  # every receiver checked the manifest
        self.close()
        return self.stats

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        self.ctl.shutdown()


class Receiver:
    """A rollout worker's end of a link (`index` 0.. among its receivers): iterate it for whole tensors."""

    def __init__(self, link: Link, index: int) -> None:
        self.link = link
        self.ctl = _Control(link, 1 + index)
        self.attached: _AttachedBuffer | None = None
        self.stats = PushStats()
        self.names: list[str] = []
        self.aliases: dict[str, str] = {}
        self._payload = (
            torch.empty(link.bucket_bytes, dtype=torch.uint8, device=link.device)
            if link.kind == "broadcast"
            else None
        )

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        partial: dict[str, torch.Tensor] = {}
        got: dict[str, int] = {}
        try:
            while True:
                header, hb = self.ctl.recv_header()
                self.stats.max_message_bytes = max(self.stats.max_message_bytes, hb)
                if header.get("end"):
                    self.names, self.aliases = list(header["names"]), dict(header["aliases"])
                    break
                n = int(header["nbytes"])
                if n > self.link.bucket_bytes:
                    raise TransportError(
                        f"a bucket of {n} bytes exceeds its {self.link.bucket_bytes}-byte limit"
                    )
                if self._payload is not None:
                    self.ctl.broadcast(self._payload, self.ctl.data)
                    payload = self._payload[:n]
                else:
                    if self.attached is None:
                        self.attached = _AttachedBuffer(header["buffer"], self.link.bucket_bytes)
                    payload = self.attached.tensor[:n]
                self.stats.bytes += sum(int(d["length"]) for d in header["pieces"])
                self.stats.buckets += 1
                self.stats.max_message_bytes = max(self.stats.max_message_bytes, n)
                done: list[tuple[str, torch.Tensor]] = []
                for p in (Piece(**{**d, "shape": tuple(d["shape"])}) for d in header["pieces"]):
                    src = payload[p.offset : p.offset + p.length]
                    if p.start == 0 and p.length == p.total:  # whole: a copy out of the bucket
                        done.append((p.name, _as_tensor(src.clone(), p)))
                        continue
                    buf = partial.setdefault(
                        p.name, torch.empty(p.total, dtype=torch.uint8, device=src.device)
                    )
                    buf[p.start : p.start + p.length].copy_(src)
                    got[p.name] = got.get(p.name, 0) + p.length
                    if got[p.name] == p.total:
                        done.append((p.name, _as_tensor(partial.pop(p.name), p)))
                        del got[p.name]
                if self._payload is None:
                    self.ctl.barrier()  # copied out: the sender may refill its buffer
                for item in done:
                    self.stats.tensors += 1
                    yield item
            if partial:
                raise TransportError(f"the push ended with tensors incomplete: {sorted(partial)[:5]}")
            self.ctl.barrier()
        finally:
            self.close()

    def close(self) -> None:
        if self.attached is not None:
            self.attached.close()
            self.attached = None
        self.ctl.shutdown()


def distinct_tensors(state: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | str]]:
    """`state` (a state dict's items, whose tensors stay alive while it is iterated) with each repeat of an
    earlier tensor object (tied weights) given as the earlier name instead: what `send_all` takes."""
    first: dict[int, str] = {}
    for name, t in state:
        if id(t) in first:
            yield name, first[id(t)]
        else:
            first[id(t)] = name
            yield name, t


def _as_tensor(raw: torch.Tensor, p: Piece) -> torch.Tensor:
    return raw.view(_dtype(p.dtype)).reshape(p.shape)


# -- both ends, whole pushes ---------------------------------------------------------------------------------
def send_all(
    named: Iterable[tuple[str, torch.Tensor | str]], links: list[Link], rank: int, device: str = "cpu"
) -> PushStats:
    """Stream `named` over every link whose `source_rank` is `rank` (the iteration runs on every rank even
    with no link: it is where the training engine gathers each tensor, a collective). An item whose value is
    a string names an alias of that earlier tensor (tied weights): it is announced, not sent. Returns this
    rank's totals."""
    mine = [link for link in links if link.source_rank == rank]
    t0 = time.perf_counter()
    senders = [Sender(link) for link in mine]
    try:
        names: list[str] = []
        aliases: dict[str, str] = {}

        def distinct() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in named:
                if isinstance(t, str):
                    aliases[name] = t
                    continue
                names.append(name)
                yield name, t

        if not senders:
            for _ in distinct():  # take part in the gathers
                pass
            return PushStats(seconds=time.perf_counter() - t0)
        spec = mine[0]
        for pieces, payload in bucketed(distinct(), spec.bucket_bytes, _dtype(spec.dtype), spec.device):
            for s in senders:
                s.send(pieces, payload)
        out = PushStats()
        for s in senders:
            st = s.finish(names, aliases)
            out.bytes += st.bytes
            out.buckets += st.buckets
            out.max_message_bytes = max(out.max_message_bytes, st.max_message_bytes)
            out.tensors = st.tensors
        out.seconds = time.perf_counter() - t0
        return out
    finally:
        for s in senders:
            s.close()


def receive_into(
    link: Link,
    index: int,
    consume: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
    expect: Iterable[str] | None = None,
) -> PushStats:
    """Receive one push over `link`, handing `consume` an iterator of whole tensors as they complete (it
    loads them; nothing here keeps them). Raise `TransportError` when the manifest names a tensor that did
    not arrive, or `expect` (the receiving model's names) holds a name the push covered neither as a tensor
    nor as an alias. Aliases (tied weights) are not loaded: a model tied like the actor's shares the
    tensor."""
    t0 = time.perf_counter()
    r = Receiver(link, index)
    arrived: set[str] = set()

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in r:
            arrived.add(name)
            yield name, tensor

    stream = tensors()
    try:
        consume(stream)
        for _ in stream:  # a consumer that stopped early: drain, so the sender is not left waiting
            pass
    finally:
        r.close()
    missing = [n for n in r.names if n not in arrived]
    if missing:
        raise TransportError(f"the push announced tensors that never arrived: {missing[:5]}")
    if expect is not None:
        absent = sorted(set(expect) - set(r.names) - set(r.aliases))
        if absent:
            raise TransportError(f"the push did not cover the rollout model's tensors {absent[:5]}")
    r.stats.seconds = time.perf_counter() - t0
    return r.stats


def plan_links(
    kind: str,
    actor_ranks: int,
    endpoints: list[tuple[str, int]],
    *,
    bucket_bytes: int,
    dtype: str,
    device: str = "cpu",
    tag: str = "push",
) -> list[Link]:
    """The links of one push to `len(endpoints)` rollout workers (one endpoint, host and free port, per
    receiver that hosts a store). `same_device`: actor rank i feeds worker i (needs as many ranks as
    workers; each worker hosts its link's store). `broadcast`: rank 0 feeds every worker over one link
    whose store the first worker hosts."""
    if kind == "same_device":
        if actor_ranks < len(endpoints):
            raise ValueError(
                f"same_device links pair each rollout worker with an actor rank, but there are "
                f"{len(endpoints)} workers and {actor_ranks} ranks"
            )
        return [
            Link("same_device", i, 1, h, p, bucket_bytes, dtype, device, f"{tag}/{i}")
            for i, (h, p) in enumerate(endpoints)
        ]
    host, port = endpoints[0]
    return [Link("broadcast", 0, len(endpoints), host, port, bucket_bytes, dtype, device, tag)]
