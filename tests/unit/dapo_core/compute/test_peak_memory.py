"""The measured peak memory of each worker process lined up with `dapo plan`'s estimate of its role."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

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
    assert after["cpu_s"] > before["cpu_s"]  # touching 16 k pages costs CPU time
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


_TRIM_PROBE = """
import ctypes
from dapo_core.compute.heap import trim_heap
from dapo_core.compute.peak_memory import rss_bytes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
blocks = [libc.malloc(64 << 10) for _ in range(4096)]  # 256 MiB of heap blocks, below the mmap threshold
for b in blocks:
    libc.memset(b, 1, 64 << 10)
keep = libc.malloc(64 << 10)  # above them all: free() alone cannot shrink the heap's top
for b in blocks:
    libc.free(b)
before = rss_bytes()
released = trim_heap()
print(int(released), (before - rss_bytes()) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's (Linux)")
def test_trim_heap_hands_freed_heap_blocks_back_to_the_os():
    # In a fresh process, so nothing else of the test session's heap is in the figure.
    out = subprocess.run(
        [sys.executable, "-c", _TRIM_PROBE],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[4],
    ).stdout.split()
    released, freed_mib = int(out[0]), int(out[1])
    assert released == 1
    assert freed_mib >= 200  # of the 256 MiB freed but still resident
