"""The measured peak memory of each worker process lined up with `dapo plan`'s estimate of its role."""

from __future__ import annotations

from types import SimpleNamespace

from dapo_core.compute.peak_memory import compare_to_plan, process_memory

GIB = 2**30


def _plan(**totals: tuple[int, int]) -> SimpleNamespace:
    return SimpleNamespace(
        roles=[SimpleNamespace(role=r, total=t, host_total=h) for r, (t, h) in totals.items()]
    )


def test_process_memory_reads_this_process():
    before = process_memory()
    block = bytearray(64 * 2**20)  # touch 64 MiB: the high-water mark reaches at least that much more
    for i in range(0, len(block), 4096):
        block[i] = 1
    after = process_memory()
    assert after["peak_rss_bytes"] >= after["rss_bytes"] > 0
    assert after["peak_rss_bytes"] >= before["rss_bytes"] + 60 * 2**20
    del block


def test_compare_lines_up_processes_with_their_role_and_takes_the_largest_rank():
    measured = [
        {"role": "actor", "rank": 0, "peak_rss_bytes": 3 * GIB, "rss_bytes": 2 * GIB},
        {"role": "actor", "rank": 1, "peak_rss_bytes": 5 * GIB, "rss_bytes": 2 * GIB},
        {"role": "rollout", "rank": 0, "peak_rss_bytes": 1 * GIB, "rss_bytes": GIB},
        {"role": "reward", "rank": 0, "peak_rss_bytes": GIB // 2, "rss_bytes": GIB // 2},
    ]
    cpu = compare_to_plan(measured, _plan(actor=(4 * GIB, 9 * GIB), rollout=(2 * GIB, 7 * GIB)), "cpu")
    assert cpu["roles"]["actor"] == {
        "peak_rss_bytes": 5 * GIB,
        "plan_bytes": 4 * GIB,
        "measured_over_plan": 1.25,
    }
    assert cpu["roles"]["rollout"]["measured_over_plan"] == 0.5
    assert cpu["roles"]["reward"] == {
        "peak_rss_bytes": GIB // 2,
        "plan_bytes": None,
        "measured_over_plan": None,
    }
    assert [p["measured_over_plan"] for p in cpu["processes"]] == [0.75, 1.25, 0.5, None]
    # on GPU a process's resident memory is the role's host rows, not its GPU rows
    gpu = compare_to_plan(measured, _plan(actor=(4 * GIB, 10 * GIB), rollout=(2 * GIB, 4 * GIB)), "cuda")
    assert gpu["roles"]["actor"]["plan_bytes"] == 10 * GIB
    assert gpu["roles"]["rollout"]["measured_over_plan"] == 0.25
