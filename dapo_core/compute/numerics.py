"""What makes a process's numbers repeatable: torch threads and deterministic algorithms, from the config.

`trainer.num_threads` (torch intra-op threads per process on CPU) and `trainer.deterministic`
(`torch.use_deterministic_algorithms`) are config values, recorded with the run (config.yaml) and tracked as
DVC params; nothing here reads the environment, so `make train`, `make repro` and a plain `dvc repro` compute
the same numbers from the same parameters whatever `OMP_NUM_THREADS` the shell has. On CPU another thread
count changes the order of float additions inside matmuls, hence the bits of every weight. `num_threads: 0`
shares the machine's cores (the process's affinity) instead: faster on a large machine, but the numbers then
depend on the machine. Precision is a config value elsewhere (`actor_rollout_ref.rollout.dtype`; training
runs in float32).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dapo_core.errors import DapoUserError

__all__ = ["available_cores", "cpu_has_bf16", "resolve_threads", "torch_numerics"]


def available_cores() -> int:
    """The cores this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags of native bfloat16 arithmetic (x86 AVX-512 BF16 and AMX; `bf16` on Arm)."""


def cpu_has_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU has native bfloat16 instructions (`BF16_CPU_FLAGS` among /proc/cpuinfo's flags, or
    `cpuinfo`'s text); None where it cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return bool(flags & set(BF16_CPU_FLAGS)) if flags else None


def resolve_threads(num_threads: int, share: int = 1, cores: int | None = None) -> int:
    """Torch threads for one process: `num_threads` when > 0; 0 = the available cores divided among `share`
    processes that compute at once. A negative value is refused naming `trainer.num_threads`."""
    if not isinstance(num_threads, int) or num_threads < 0:
        raise DapoUserError(
            f"trainer.num_threads={num_threads!r} is not a whole number >= 0",
            where="trainer.num_threads",
            fix="set it to 1 (the CPU default: the same numbers on every machine) or 0 (share the cores)",
        )
    if num_threads > 0:
        return num_threads
    return max(1, (available_cores() if cores is None else cores) // max(1, share))


@contextmanager
def torch_numerics(num_threads: int, deterministic: bool) -> Iterator[int]:
    """Run the block with `resolve_threads(num_threads)` torch threads and deterministic algorithms on or off;
    restores the process's previous settings afterwards. Yields the thread count. Deterministic cuBLAS needs
    its fixed workspace (`CUBLAS_WORKSPACE_CONFIG`), set here unless the environment has one."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch  # here, so that the preflight can check the thread count without importing torch

    threads = resolve_threads(num_threads)
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    try:
        yield threads
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)
