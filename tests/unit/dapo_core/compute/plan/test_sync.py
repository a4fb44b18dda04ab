"""The weight push's plan (dapo_core.compute.plan.sync) against a real push of the tiny model between
processes over `weight_transport`."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_core.compute.plan import (
    make_plan,
)
from dapo_core.config import load_config, typed
from tests.unit.dapo_core.compute.plan.support import (
    CONFIGS,
)


def _resident_weights(folder: str) -> dict:
    """The tiny model's tensors, read from its safetensors file into resident memory (a model's weights as
    the actor and the rollout hold them), without importing transformers (the child starts faster)."""
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    state = {k: v.clone() for k, v in load_file(str(Path(folder) / "model.safetensors")).items()}
    return state


def _push_send(folder: str, links: list, out) -> None:
    import traceback

    try:
        from dapo_core.compute import weight_transport as wt
        from dapo_core.compute.peak_memory import rss_bytes

        state = _resident_weights(folder)
        base = rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        st = wt.send_all(wt.distinct_tensors(state.items()), [wt.Link(**d) for d in links], 0)
        out.put(("sender", st.bytes, st.max_message_bytes, st.seconds, rss_bytes("VmHWM") - base))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _push_receive(folder: str, link: dict, index: int, out) -> None:
    import traceback

    try:
        from dapo_core.compute import weight_transport as wt
        from dapo_core.compute.peak_memory import rss_bytes

        state = _resident_weights(folder)
        base = rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

        def load(named) -> None:  # what the HF engine's load_tensors does: a copy into each weight
            for name, t in named:
                state[name].copy_(t)

        st = wt.receive_into(wt.Link(**link), index, load, list(state))
        out.put(("receiver", st.bytes, st.max_message_bytes, st.seconds, rss_bytes("VmHWM") - base))
    except BaseException:
        out.put(("error", traceback.format_exc()))


@pytest.mark.slow  # real processes: in the full suite, not `make test`
@pytest.mark.parametrize("kind", ["same_device", "broadcast"])
def test_a_real_push_of_the_tiny_model_moves_the_planned_bytes(kind, tmp_path, monkeypatch):
    """A push of a tiny model whose MLP tensors (512 × 8192 float32, 16 MiB) split over 8 MiB buckets, over
    `weight_transport` between real processes, planned with the same link kind: the plan's bytes per link
    are the transport's `bytes` on every end, no message exceeds the plan's bucket, and each end's resident
    growth during the push stays within 1.5× the plan's rows of the push's pass + 8 MiB (allocator and page
    timing add a few MiB on a busy machine, large beside the sender's 2 MiB of rows): below the model
    (98 MiB), which an end holding the whole set would add. The figures are printed."""
    import multiprocessing as mp
    from dataclasses import asdict

    from dapo_core.compute import weight_transport as wt
    from dapo_core.compute.dist import free_port
    from dapo_core.compute.models import build_tiny_model

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    shape = [
        "actor_rollout_ref.model.tiny.hidden_size=512",
        "actor_rollout_ref.model.tiny.intermediate_size=8192",
        "actor_rollout_ref.model.tiny.num_hidden_layers=2",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=8",
        f"actor_rollout_ref.rollout.weight_transport={kind}",
    ]
    cfg = typed(load_config(CONFIGS / "tiny_cpu.yaml", shape))
    plan = make_plan(cfg, device="cpu")
    sync = plan.sync
    assert sync is not None and (sync.kind, sync.bucket) == (kind, 8 << 20)
    assert plan.shape.largest_params * 4 == 16 << 20
    folder = str(build_tiny_model(str(tmp_path), dict(vars(cfg.actor_rollout_ref.model.tiny)), seed=0))
    n = 1 if kind == "same_device" else 2
    link = wt.Link(
        kind, 0, n, "127.0.0.1", free_port("127.0.0.1"), sync.bucket, "float32", tag=f"plan-{kind}"
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_push_send, args=(folder, [asdict(link)], out))]
    procs += [ctx.Process(target=_push_receive, args=(folder, asdict(link), i, out)) for i in range(n)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [g[1] for g in got if g[0] == "error"]
    assert not errors, errors[0]
    rows = {role.role: {r.name: r.bytes for r in role.rows if r.phase == "sync"} for role in plan.roles}
    sender = next(g for g in got if g[0] == "sender")
    receivers = [g for g in got if g[0] == "receiver"]
    print(f"{kind}: plan {sync.per_link:,} B per link, rows {rows}; measured {got}")
    for _, nbytes, max_msg, _, _ in [sender, *receivers]:
        assert nbytes == sync.per_link
        assert max_msg <= sync.bucket
    # The resident growth of each end during the push against the plan's rows of its pass.
    for g, role in [(sender, "actor"), *((r, "rollout") for r in receivers)]:
        planned = sum(rows[role].values())
        assert g[4] <= 1.5 * planned + (8 << 20) < sync.per_link, (g, role, rows)
