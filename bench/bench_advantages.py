"""Benchmark: loop `grpo` vs scatter-based `grpo_vectorized` advantage estimators.

Times both estimators on B = groups × n trajectories (n samples per uid, response length L) with uuid4-hex
string labels, as the trainer passes them, on one CPU thread, and prints the median of `--repeats`
runs for each size. Also checks the two results agree (rtol 1e-5).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_advantages.py            # 1k / 10k / 100k groups
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_advantages.py --groups 1000 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import torch

from dapo_core.algo.advantages import compute_advantage


def make_batch(
    groups: int, n: int, length: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Binary (±1) outcome rewards at the last valid token, ragged lengths, one uid per group."""
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    lengths = torch.randint(1, length + 1, (B,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.int8)
    scores = torch.randint(0, 2, (B,), generator=g).float() * 2 - 1
    rewards = torch.zeros(B, length)
    rewards[torch.arange(B), lengths - 1] = scores
    uids = [uuid.UUID(int=int(x)).hex for x in torch.randint(0, 2**62, (groups,), generator=g)]
    index = [u for u in uids for _ in range(n)]
    return rewards, mask, index


def median_time(name: str, rewards: torch.Tensor, mask: torch.Tensor, index: list[str], repeats: int):
    """Median wall time (seconds) of `repeats` calls, and the last result."""
    times = []
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, _ = compute_advantage(name, rewards, mask, index)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    """Parse arguments, run the sizes, print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--n", type=int, default=16, help="samples per group (rollout.n)")
    parser.add_argument("--length", type=int, default=8, help="padded response length L")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print(f"n={args.n} L={args.length} threads={torch.get_num_threads()} median of {args.repeats}")
    print(f"{'groups':>8} {'rows':>9} {'grpo (s)':>10} {'vectorized (s)':>15} {'speed-up':>9}")
    for groups in args.groups:
        rewards, mask, index = make_batch(groups, args.n, args.length)
        t_loop, a = median_time("grpo", rewards, mask, index, args.repeats)
        t_vec, b = median_time("grpo_vectorized", rewards, mask, index, args.repeats)
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise SystemExit(f"grpo and grpo_vectorized disagree at {groups} groups")
        print(f"{groups:>8} {groups * args.n:>9} {t_loop:>10.4f} {t_vec:>15.4f} {t_loop / t_vec:>8.1f}x")


if __name__ == "__main__":
    main()
