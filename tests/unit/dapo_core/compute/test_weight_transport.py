"""The bucketed weight transport (`dapo_core.compute.weight_transport`) between real processes: a
same-device link through shared memory and a gloo broadcast link, tensors split over buckets, aliases, no
message larger than the bucket, and a push that does not deliver the whole set refused."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from typing import Any

import pytest
import torch

from dapo_core.compute import weight_transport as wt
from dapo_core.compute.dist import free_port

BUCKET = 4096


def _weights() -> list[tuple[str, torch.Tensor | str]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(40, 33, generator=g)),  # 5,280 bytes in fp32: split over buckets
        ("norm.weight", torch.randn(7, generator=g)),
        ("empty.bias", torch.zeros(0)),
        ("layer.weight", torch.randn(16, 16, generator=g)),
        ("head.weight", "embed.weight"),  # tied
        ("ids", torch.arange(300, dtype=torch.int64)),
    ]


def test_buckets_hold_at_most_bucket_bytes_and_reassemble():
    named = [(n, t) for n, t in _weights() if not isinstance(t, str)]
    got: dict[str, bytearray] = {}
    for pieces, payload in wt.bucketed(named, 1000, torch.bfloat16):
        assert payload.numel() <= 1000
        for p in pieces:
            assert p.offset % 64 == 0 and p.offset + p.length <= payload.numel()
            buf = got.setdefault(p.name, bytearray(p.total))
            buf[p.start : p.start + p.length] = payload[p.offset : p.offset + p.length].numpy().tobytes()
    for name, t in named:
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert bytes(got.get(name, b"")) == want.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _send(links: list[dict], out: Any, dtype: str) -> None:
    try:
        stats = wt.send_all(iter(_weights()), [wt.Link(**d) for d in links], rank=0)
        out.put(("sender", stats.bytes, stats.max_message_bytes, stats.buckets))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _receive(link: dict, index: int, out: Any, expect: list[str] | None) -> None:
    try:
        loaded: dict[str, list] = {}

        def load(named) -> None:
            for name, t in named:
                loaded[name] = [
                    str(t.dtype),
                    list(t.shape),
                    t.float().sum().item(),
                    t.float().view(-1)[:3].tolist(),
                ]

        stats = wt.receive_into(wt.Link(**link), index, load, expect=expect)
        out.put(("receiver", index, loaded, stats.max_message_bytes))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _run(links: list[wt.Link], receivers: list[tuple[wt.Link, int]], expect: list[str] | None = None) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    from dataclasses import asdict

    procs = [ctx.Process(target=_send, args=([asdict(x) for x in links], out, "bfloat16"))]
    procs += [ctx.Process(target=_receive, args=(asdict(link), i, out, expect)) for link, i in receivers]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            item = out.get(timeout=180)
            if item[0] == "error":
                results.append(item)
                break
            results.append(item)
    except queue.Empty:
        pytest.fail("a transport process gave no result within 180 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def _expected() -> dict[str, list]:
    want = {}
    for name, t in _weights():
        if isinstance(t, str):  # aliases are announced, not loaded
            continue
        src = t
        v = src.to(torch.bfloat16) if src.is_floating_point() else src
        want[name] = [str(v.dtype), list(v.shape), v.float().sum().item(), v.float().view(-1)[:3].tolist()]
    return want


@pytest.mark.slow  # real processes: in the full suite, not `make test`
@pytest.mark.parametrize("kind", ["same_device", "broadcast"])
def test_a_push_delivers_every_tensor_in_the_rollout_dtype(kind):
    n = 1 if kind == "same_device" else 2
    link = wt.Link(kind, 0, n, "127.0.0.1", free_port("127.0.0.1"), BUCKET, "bfloat16", tag=f"t-{kind}")
    results = _run([link], [(link, i) for i in range(n)])
    errors = [r[1] for r in results if r[0] == "error"]
    assert not errors, errors[0]
    sender = next(r for r in results if r[0] == "sender")
    received = [r for r in results if r[0] == "receiver"]
    assert len(received) == n
    for _, _, loaded, max_msg in received:
        assert loaded == _expected()
        assert max_msg <= BUCKET
    _, nbytes, max_msg, buckets = sender
    assert max_msg <= BUCKET and buckets >= 2
    assert nbytes == sum(
        t.numel() * (2 if t.is_floating_point() else t.element_size())
        for _, t in _weights()
        if not isinstance(t, str)
    )


@pytest.mark.slow  # real processes: in the full suite, not `make test`
def test_a_push_that_misses_a_model_tensor_is_refused():
    link = wt.Link("same_device", 0, 1, "127.0.0.1", free_port("127.0.0.1"), BUCKET, "float32", tag="t-miss")
    results = _run([link], [(link, 0)], expect=[n for n, _ in _weights()] + ["lm_head.extra"])
    errors = [r[1] for r in results if r[0] == "error"]
    assert errors and "did not cover the rollout model's tensors ['lm_head.extra']" in errors[0]


def _failing_receive(link: dict, out: Any, done: Any) -> None:
    """A receiver whose engine fails on the first tensor, then stays alive (as a Ray worker does) until
    the test has the sender's outcome."""
    try:

        def load(named) -> None:
            next(iter(named))
            raise RuntimeError("the engine refused a tensor")

        wt.receive_into(wt.Link(**link), 0, load)
    except BaseException as exc:
        kept = exc  # held, as a worker's error is held until reported: its frames keep the receiver alive
        out.put(("receiver", str(kept)))
        done.wait(timeout=600)


def _timed_send(link: dict, out: Any) -> None:
    import time

    t0 = time.monotonic()
    try:
        wt.send_all(iter(_weights()), [wt.Link(**link)], rank=0)
        out.put(("sender", "finished", time.monotonic() - t0))
    except BaseException as exc:
        out.put(("sender", type(exc).__name__, time.monotonic() - t0))


@pytest.mark.slow  # real processes: in the full suite, not `make test`
def test_a_receiver_that_fails_mid_push_fails_the_sender_at_once():
    from dataclasses import asdict

    link = wt.Link("same_device", 0, 1, "127.0.0.1", free_port("127.0.0.1"), 1024, "float32", tag="t-fail")
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_timed_send, args=(asdict(link), out)),
        ctx.Process(target=_failing_receive, args=(asdict(link), out, done)),
    ]
    for p in procs:
        p.start()
    try:
        got = {r[0]: r for r in (out.get(timeout=300) for _ in procs)}
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert "the engine refused a tensor" in got["receiver"][1]
    _, outcome, seconds = got["sender"]
    assert outcome != "finished" and seconds < wt.TIMEOUT.total_seconds() / 4, got["sender"]


def test_plan_pairs_ranks_with_workers_or_broadcasts_from_rank_0():
    eps = [("10.0.0.1", 7001), ("10.0.0.2", 7002)]
    same = wt.plan_links("same_device", 2, eps, bucket_bytes=BUCKET, dtype="bfloat16")
    assert [(x.source_rank, x.host, x.port, x.receivers) for x in same] == [
        (0, "10.0.0.1", 7001, 1),
        (1, "10.0.0.2", 7002, 1),
    ]
    (b,) = wt.plan_links("broadcast", 4, eps, bucket_bytes=BUCKET, dtype="bfloat16")
    assert (b.kind, b.source_rank, b.receivers, b.host) == ("broadcast", 0, 2, "10.0.0.1")
    with pytest.raises(ValueError, match="2 workers and 1 ranks"):
        wt.plan_links("same_device", 1, eps, bucket_bytes=BUCKET, dtype="bfloat16")


BIG_TENSORS, BIG_ELEMS = 17, 256 << 20  # 17 × 256 MiB = 4.25 GiB, over the 2³²-byte single-message limit


def _big_send(link: dict, out: Any) -> None:
    try:
        named = ((f"w{i}", torch.full((BIG_ELEMS,), i % 251, dtype=torch.uint8)) for i in range(BIG_TENSORS))
        stats = wt.send_all(named, [wt.Link(**link)], rank=0)
        out.put(("sender", stats.bytes, stats.max_message_bytes, stats.seconds))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _big_receive(link: dict, out: Any) -> None:
    try:
        bad: list[str] = []

        def load(named) -> None:
            for name, t in named:
                v = int(name[1:]) % 251
                if t.numel() != BIG_ELEMS or int(t.min()) != v or int(t.max()) != v:
                    bad.append(name)

        stats = wt.receive_into(wt.Link(**link), 0, load)
        out.put(("receiver", stats.bytes, bad, stats.seconds))
    except BaseException:
        out.put(("error", traceback.format_exc()))


@pytest.mark.slow
def test_a_weight_set_over_4_gib_crosses_in_buckets():
    """17 tensors of 256 MiB through 64 MiB buckets: no message over the bucket, every byte arrives."""
    from dataclasses import asdict

    link = wt.Link("same_device", 0, 1, "127.0.0.1", free_port("127.0.0.1"), 64 << 20, "float32", tag="big")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_big_send, args=(asdict(link), out)),
        ctx.Process(target=_big_receive, args=(asdict(link), out)),
    ]
    for p in procs:
        p.start()
    try:
        results = {r[0]: r for r in (out.get(timeout=600) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert "error" not in results, results["error"][1]
    total = BIG_TENSORS * BIG_ELEMS
    assert total > 4 << 30
    assert results["sender"][1] == total and results["sender"][2] <= 64 << 20
    assert results["receiver"][1] == total and results["receiver"][2] == []
    print(
        f"4.25 GiB pushed in {results['sender'][3]:.1f} s ({total / results['sender'][3] / 2**30:.2f} GiB/s)"
    )
